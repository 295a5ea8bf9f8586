"""Engine spec strings: `name` or `name:key=value[,key=value…]` (reference §3.1), parsed strictly.

A spec is split at the first `:`, its parameters on `,` and each parameter at the first `=`.
Names are case-insensitive and trimmed. Anything the catalog does not know — an engine name, a
parameter, a value of the wrong type or out of range — is an `EngineSpecError` that names what
was wrong and what is accepted (DESIGN decision 3: never a silent default).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from larql.errors import LarqlError
from larql.inference.engine import AnyEngine, KvEngine, RetrievalEngine
from larql.models.model import Model


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


@dataclass(frozen=True)
class Param:
    name: str
    type: type  # int, float or str
    default: Any  # None = absent (e.g. unbounded window)
    doc: str
    check: Callable[[Any], str | None] | None = None  # returns an error message or None

    def parse(self, raw: str, engine: str) -> Any:
        try:
            value = self.type(raw)
        except ValueError:
            kind = {int: "an integer", float: "a number", str: "a string"}[self.type]
            raise MalformedEngineSpec(
                f"{engine}: {self.name}={raw!r} is not {kind}; {self.name}: {self.doc}"
            ) from None
        if self.type is str and not value:
            raise MalformedEngineSpec(f"{engine}: {self.name} must not be empty")
        problem = self.check(value) if self.check else None
        if problem:
            raise MalformedEngineSpec(f"{engine}: {self.name}={raw} {problem}")
        return value

    def describe(self) -> str:
        default = "none" if self.default is None else self.default
        return f"{self.name}={self.type.__name__} (default {default})"


def at_least(n: int) -> Callable[[Any], str | None]:
    return lambda v: None if v >= n else f"must be ≥ {n}"


def one_of(*allowed: Any) -> Callable[[Any], str | None]:
    choices = ", ".join(str(a) for a in allowed)
    return lambda v: None if v in allowed else f"must be one of {choices}"


# The factory gets the resolved parameters and, when known, the model it will decode with.
Factory = Callable[[Mapping[str, Any], Model | None], KvEngine | RetrievalEngine]


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

    @property
    def all_names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)


@dataclass(frozen=True)
class EngineKind:
    """A parsed spec: which engine and its parameters (defaults filled in)."""

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
        `EngineKind`."""
        defaults = {p.name: p.default for p in self.entry.params}
        shown = [f"{k}={v}" for k, v in self.params.items() if v is not None and v != defaults[k]]
        return f"{self.entry.name}:{','.join(shown)}" if shown else self.entry.name

    def build(self, model: Model | None = None, profiling: bool = False) -> AnyEngine:
        engine = self.entry.factory({**self.params, "profiling": profiling}, model)
        return AnyEngine(engine)

    def require_live_decode(self) -> None:
        if not self.entry.live_decode:
            raise NotAvailableForLiveDecode(
                f"{self.entry.name} is not available for live decode (run, walk, serve); "
                "use it with `larql bench` or `larql accuracy`"
            )


class EngineCatalog:
    """The engines `from_name` knows, in display order."""

    def __init__(self) -> None:
        self._entries: list[EngineEntry] = []
        self._by_name: dict[str, EngineEntry] = {}

    def register(self, entry: EngineEntry) -> None:
        for name in entry.all_names:
            if name in self._by_name:
                raise ValueError(f"engine name {name!r} registered twice")
            self._by_name[name] = entry
        self._entries.append(entry)

    @property
    def entries(self) -> tuple[EngineEntry, ...]:
        return tuple(self._entries)

    def supported_names(self) -> list[str]:
        return [e.name for e in self._entries]

    def supported_message(self) -> str:
        return "supported: " + ", ".join(self.supported_names())

    def from_name(self, spec: str) -> EngineKind:
        try:
            return self._parse(spec)
        except MalformedEngineSpec as e:
            raise MalformedEngineSpec(f"{e} ({self.supported_message()})") from None

    def _parse(self, spec: str) -> EngineKind:
        name, colon, raw_params = spec.partition(":")
        name = name.strip().lower()
        entry = self._by_name.get(name)
        if entry is None:
            shown = repr(spec.strip()) if spec.strip() else "an empty spec"
            raise UnknownEngine(f"unknown engine {shown}; {self.supported_message()}")
        if colon and not raw_params.strip():
            raise MalformedEngineSpec(
                f"{spec.strip()!r} has a ':' but no parameters; write {entry.name!r} alone, or "
                f"{entry.name}:key=value; {self._accepted(entry)}"
            )
        params: dict[str, Any] = {p.name: p.default for p in entry.params}
        fixed = entry.fixed.get(name, {})
        params.update(fixed)
        seen: set[str] = set()
        for piece in raw_params.split(",") if raw_params.strip() else []:
            key, eq, raw = piece.partition("=")
            key = key.strip()
            if not eq or not key:
                raise MalformedEngineSpec(
                    f"{entry.name}: {piece.strip()!r} is not key=value; {self._accepted(entry)}"
                )
            param = entry.param(key)
            if param is None:
                raise MalformedEngineSpec(
                    f"{entry.name}: unknown parameter {key!r}; {self._accepted(entry)}"
                )
            if key in seen:
                raise MalformedEngineSpec(f"{entry.name}: {key} given twice")
            seen.add(key)
            value = param.parse(raw.strip(), entry.name)
            if key in fixed and fixed[key] != value:
                raise MalformedEngineSpec(
                    f"{name} fixes {key}={fixed[key]}; use {entry.name}:{key}={value} instead"
                )
            params[key] = value
        return EngineKind(entry, params)

    def parses(self, spec: str) -> bool:
        try:
            self.from_name(spec)
        except EngineSpecError:
            return False
        return True

    def split_specs(self, specs: str) -> list[str]:
        """Split an engine list (reference §3.4). With `;` anywhere, `;` separates specs.
        Otherwise commas do, except that a piece which does not parse on its own continues
        the previous spec (`boundary-kv:chunk_tokens=64,sequence_id=demo` stays one)."""
        if ";" in specs:
            return [s.strip() for s in specs.split(";") if s.strip()]
        out: list[str] = []
        for piece in (p.strip() for p in specs.split(",")):
            if not piece:
                continue
            if out and not self.parses(piece) and _looks_like_param(piece):
                out[-1] = f"{out[-1]},{piece}"
            else:
                out.append(piece)
        return out

    @staticmethod
    def _accepted(entry: EngineEntry) -> str:
        if not entry.params:
            return f"{entry.name} takes no parameters"
        return "accepted: " + ", ".join(p.describe() for p in entry.params)


def _looks_like_param(piece: str) -> bool:
    return "=" in piece and ":" not in piece.split("=", 1)[0]
