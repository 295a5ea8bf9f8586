"""Engine specs: the catalog of engines (`EngineCatalog`, one `EngineEntry` per engine) and what
parsing a spec string gives (`EngineSpec`). The grammar — `name` or
`name:key=value[,key=value…]`, strict — is `larql.specs`'; anything the catalog does not know (an
engine name, a parameter, a value of the wrong type or out of range) is an `EngineSpecError`
that names what was wrong and what is accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from larql.errors import LarqlError
from larql.inference.engine import Engine
from larql.models.model import Model
from larql.specs import Param, accepted, parse_params, split_name, split_specs


class EngineSpecError(LarqlError):
    """An engine spec that does not parse; the message lists the supported engines."""


class UnknownEngine(EngineSpecError):
    pass


class MalformedEngineSpec(EngineSpecError):
    pass


class EngineBuildError(EngineSpecError):
    """A spec that parses but cannot be built for this model (e.g. a layer-count mismatch)."""


class NotAvailableForLiveDecode(EngineSpecError):
    """Retrieval engines serve bench and accuracy, not run / walk / serve."""


# The factory gets the resolved parameters and, when known, the model it will decode with.
Factory = Callable[[Mapping[str, Any], Model | None], Engine]


@dataclass(frozen=True)
class EngineEntry:
    """One engine of the catalog: names, parameters, what it keeps and what it promises."""

    name: str
    aliases: tuple[str, ...]
    params: tuple[Param, ...]
    keeps: str
    contract: str
    factory: Factory
    kind: Literal["kv", "retrieval"] = "kv"
    live_decode: bool = True
    # aliases that fix parameters, e.g. tq3 → bits=3
    fixed: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # how its decode steps batch with other sessions' (larql serve's continuous batching); empty:
    # each session steps alone
    batching: str = ""
    # the distribution that registered it through the `larql.engines` entry points (None for a
    # built-in engine); the catalog sets it
    plugin: str | None = None

    @property
    def all_names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)


@dataclass(frozen=True)
class EngineSpec:
    """A parsed engine spec: which engine and its parameters (defaults filled in)."""

    entry: EngineEntry
    params: Mapping[str, Any]

    @property
    def display_name(self) -> str:
        return self.entry.name

    @property
    def live_decode(self) -> bool:
        return self.entry.live_decode

    def spec(self) -> str:
        """Canonical spec string (defaults left out); parsing it gives back an equal
        `EngineSpec`."""
        defaults = {p.name: p.default for p in self.entry.params}
        shown = [f"{k}={v}" for k, v in self.params.items() if v is not None and v != defaults[k]]
        return f"{self.entry.name}:{','.join(shown)}" if shown else self.entry.name

    def build(self, model: Model | None = None, profiling: bool = False) -> Engine:
        engine = self.entry.factory({**self.params, "profiling": profiling}, model)
        engine.spec_string = self.spec()
        return engine

    def require_live_decode(self) -> None:
        if not self.entry.live_decode:
            raise NotAvailableForLiveDecode(
                f"{self.entry.name} is not available for live decode (run, walk, serve); "
                "use it with `larql bench` or `larql accuracy`"
            )


# Given the names already taken, the entries to add after the built-ins (the plugins).
Extensions = Callable[[Iterable[str]], Iterable[EngineEntry]]


class EngineCatalog:
    """The engines `parse_engine` knows, in display order: the entries given, then what
    `extensions` adds, read the first time the catalog is used (so that a plugin importing
    larql finds it whole)."""

    def __init__(
        self, entries: Sequence[EngineEntry] = (), extensions: Extensions | None = None
    ) -> None:
        self._entries: list[EngineEntry] = []
        self._by_name: dict[str, EngineEntry] = {}
        for entry in entries:
            self.register(entry)
        self._extensions = extensions

    def register(self, entry: EngineEntry) -> None:
        taken = [name for name in entry.all_names if name in self._by_name]
        if taken:
            raise ValueError(f"engine name {taken[0]!r} registered twice")
        for name in entry.all_names:
            self._by_name[name] = entry
        self._entries.append(entry)

    def _extend(self) -> None:
        extensions, self._extensions = self._extensions, None  # once, even if one re-enters
        if extensions is not None:
            for entry in extensions(tuple(self._by_name)):
                self.register(entry)

    @property
    def entries(self) -> tuple[EngineEntry, ...]:
        self._extend()
        return tuple(self._entries)

    def supported_names(self) -> list[str]:
        return [e.name for e in self.entries]

    def supported_message(self) -> str:
        return "supported: " + ", ".join(self.supported_names())

    def parse(self, spec: str) -> EngineSpec:
        try:
            return self._parse(spec)
        except MalformedEngineSpec as e:
            raise MalformedEngineSpec(f"{e} ({self.supported_message()})") from None

    def _parse(self, spec: str) -> EngineSpec:
        self._extend()
        written, raw_params, colon = split_name(spec)
        name = written.lower()
        entry = self._by_name.get(name)
        if entry is None:
            shown = repr(spec.strip()) if spec.strip() else "an empty spec"
            raise UnknownEngine(f"unknown engine {shown}; {self.supported_message()}")
        params = parse_params(
            entry.name,
            entry.params,
            raw_params,
            colon,
            MalformedEngineSpec,
            fixed=entry.fixed.get(name),
            alias=name,
        )
        return EngineSpec(entry, params)

    def parses(self, spec: str) -> bool:
        try:
            self.parse(spec)
        except EngineSpecError:
            return False
        return True

    def split_specs(self, specs: str) -> list[str]:
        """Split an engine list: with `;` anywhere, `;` separates specs; otherwise commas do,
        except that a piece which does not parse on its own continues the previous spec
        (`boundary-kv:chunk_tokens=64,sequence_id=demo` stays one)."""
        return split_specs(specs, self.parses)

    @staticmethod
    def _accepted(entry: EngineEntry) -> str:
        return accepted(entry.name, entry.params)
