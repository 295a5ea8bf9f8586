"""Engine specs: the catalog of engines (`EngineCatalog`, one `EngineEntry` per engine) and what
parsing a spec string gives (`EngineSpec`). The grammar — `name` or
`name:key=value[,key=value…]`, strict — is `larql.specs`'; anything the catalog does not know (an
engine name, a parameter, a value of the wrong type or out of range) is an `EngineSpecError`
that names what was wrong and what is accepted.

A spec is parsed under a `SpecPolicy`, which says who wrote it. The operator's (`larql run
--engine`, `larql serve --engine`, the Python API: no policy) may name paths and file names;
a request's (`SpecPolicy.untrusted`) may not, and every integer that sizes something must fit
the model and the server's limits. Both are read from the parameters themselves (`Param.kind`,
`Param.bound`), at every depth: a `spec` parameter (semantic-promotion's `base`) is parsed
under the same policy when its engine is, so its factory gets an `EngineSpec` already checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from larql.errors import LarqlError
from larql.inference.engine import Engine
from larql.models.model import Model
from larql.specs import Bound, Param, accepted, parse_params, split_name, split_specs

# How deep `spec` parameters may nest engines (a wrapper of a wrapper of …).
MAX_SPEC_DEPTH = 4


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


class SpecRefused(EngineSpecError):
    """A spec the grammar accepts but its policy does not; the message names the engine, the
    parameter and why."""


class OperatorOnlyParameter(SpecRefused):
    """A path or a file name in a spec that came from a request."""


class BeyondBound(SpecRefused):
    """An integer past what the model or the server allows."""


# ---------------------------------------------------------------------------- the policy

# Bounds of the catalog's integer parameters (`larql.specs.Bound`).
TOKENS = Bound("tokens")  # a count of positions: ≤ the context (and the server's limit)
MODEL_LAYERS = Bound("layers", always=True)  # a count of layers: ≤ the model's depth
LAYER_INDEX = Bound("layers", index=True, always=True)  # one of the model's layers
HEAD_DIM = Bound("head_dim")  # coordinates of one head vector
TOKEN_ID = Bound("vocab", index=True, always=True)  # an id of the model's vocabulary


@dataclass(frozen=True)
class Limit:
    """One dimension's size and how a message names it (`the model's 30 layers`)."""

    size: int
    what: str


def model_limits(model: Model, max_tokens: int | None = None) -> dict[str, Limit]:
    """Every dimension a `Bound` may name, for `model` (and a server taking at most
    `max_tokens` tokens per sequence: the tighter of that and the context bounds `tokens`)."""
    config = model.config
    head_dim = max(config.head_dim_of(layer) for layer in range(config.num_layers))
    tokens = Limit(config.max_positions, f"the model's context of {config.max_positions} tokens")
    if max_tokens is not None and max_tokens < tokens.size:
        tokens = Limit(max_tokens, f"this server's limit of {max_tokens} tokens per request")
    return {
        "tokens": tokens,
        "layers": Limit(config.num_layers, f"the model's {config.num_layers} layers"),
        "heads": Limit(config.num_heads, f"the model's {config.num_heads} attention heads"),
        "head_dim": Limit(head_dim, f"the model's head_dim of {head_dim}"),
        "vocab": Limit(config.vocab_size, f"the model's vocabulary of {config.vocab_size} ids"),
    }


@dataclass(frozen=True)
class SpecPolicy:
    """What a spec may say beyond the grammar. `files`: `path` and `name` parameters are
    accepted (only the operator's specs may touch the machine's files). `limits`: the sizes
    `Bound`s are checked against (none known: nothing to check); `every_bound` checks them
    all, otherwise only those past which an engine cannot work (`Bound.always`). The default,
    `SpecPolicy()`, is the operator's before the model is known."""

    files: bool = True
    limits: Mapping[str, Limit] = field(default_factory=dict)
    every_bound: bool = False

    @classmethod
    def untrusted(cls, model: Model, max_tokens: int | None = None) -> SpecPolicy:
        """A request's: no paths or file names, every bound checked against `model` and
        `max_tokens` (the server's own limit on a sequence's tokens, if it has one)."""
        return cls(files=False, limits=model_limits(model, max_tokens), every_bound=True)

    @classmethod
    def operator(cls, model: Model) -> SpecPolicy:
        """The operator's, once the model is known: what could only fail later is refused."""
        return cls(files=True, limits=model_limits(model))

    def admit(self, owner: str, param: Param, value: Any) -> None:
        """Raise `SpecRefused` if `owner`'s `param` may not be `value` under this policy."""
        if value is None:
            return
        if param.kind in ("path", "name") and not self.files:
            what = "a path" if param.kind == "path" else "a file"
            raise OperatorOnlyParameter(
                f"{owner}: {param.name} names {what} on the server; only the operator sets it "
                "(larql serve --engine)"
            )
        bound = param.bound
        if bound is None or not (self.every_bound or bound.always):
            return
        limit = self.limits.get(bound.dimension)
        if limit is None:
            return
        if bound.index and value >= limit.size:
            raise BeyondBound(
                f"{owner}: {param.name}={value} is out of range 0..{limit.size - 1} ({limit.what})"
            )
        if value > limit.size:
            raise BeyondBound(f"{owner}: {param.name}={value} is more than {limit.what}")


# The factory gets the resolved parameters and, when known, the model it will decode with.
Factory = Callable[[Mapping[str, Any], Model | None], Engine]


@dataclass(frozen=True)
class Sweeps:
    """The specs of an engine the harnesses run when they are given none, as parameter lists
    ("" is the engine with its defaults): `bench` (a 128-token context: windows of a few
    tokens, so a windowed engine's overflow path runs), `accuracy` (the prompts suite and its
    fidelity text: windows of 64) and `longctx` (the long-context suites, thousands of tokens:
    the engines that keep less than the full cache). A new engine runs everywhere with its
    defaults unless its entry says otherwise."""

    bench: tuple[str, ...] = ("",)
    accuracy: tuple[str, ...] = ("",)
    longctx: tuple[str, ...] = ("",)

    def specs(self, name: str, suite: str) -> list[str]:
        return [f"{name}:{p}" if p else name for p in getattr(self, suite)]


@dataclass(frozen=True)
class EngineEntry:
    """One engine of the catalog: names, parameters, what it keeps and what it promises."""

    name: str
    aliases: tuple[str, ...]
    params: tuple[Param, ...]
    keeps: str
    contract: str
    factory: Factory
    # what it is for, in one short line (`larql engines`' compact table)
    purpose: str = ""
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
    # what the harnesses run of it by default
    sweeps: Sweeps = field(default_factory=Sweeps)
    # it re-runs the whole context at every step (O(N²)): runs over long texts are capped
    quadratic: bool = False
    # FFN backend kinds (`FfnBackend.kind`) it may not run with, and why ("it …")
    refuses_ffn: Mapping[str, str] = field(default_factory=dict)

    @property
    def all_names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def summary(self) -> str:
        """`purpose`, or (an entry that declares none) what it keeps up to the first `;`."""
        return self.purpose or self.keeps.split(";")[0]

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
        values = {k: v.spec() if isinstance(v, EngineSpec) else v for k, v in self.params.items()}
        shown = [f"{k}={v}" for k, v in values.items() if v is not None and v != defaults[k]]
        return f"{self.entry.name}:{','.join(shown)}" if shown else self.entry.name

    def build(self, model: Model | None = None, profiling: bool = False) -> Engine:
        """The engine. With the model known, a value past one of its dimensions that the engine
        cannot work with (`Bound.always`) is refused first, whoever wrote the spec."""
        if model is not None:
            self.check(SpecPolicy.operator(model))
        engine = self.entry.factory({**self.params, "profiling": profiling}, model)
        engine.spec_string = self.spec()
        if self.entry.refuses_ffn:
            engine.refused_ffn = self.entry.refuses_ffn
        return engine

    def check(self, policy: SpecPolicy) -> None:
        """Raise `SpecRefused` if a value of this spec (not of a nested one: their engines'
        factories build them) is one `policy` refuses."""
        for param in self.entry.params:
            if not isinstance(self.params.get(param.name), EngineSpec):
                policy.admit(self.entry.name, param, self.params.get(param.name))

    def require_live_decode(self) -> None:
        if not self.entry.live_decode:
            raise NotAvailableForLiveDecode(
                f"{self.entry.name} is not available for live decode (run, walk, serve); "
                "use it with `larql bench` or `larql accuracy`"
            )


# Given the names already taken, the entries to add after the built-ins (the plugins).
Extensions = Callable[[Iterable[str]], Iterable[EngineEntry]]

# A spec that composes engines (`A+B`, `larql.kv.composed`) → what it names, or None where it
# composes nothing; given how to parse one half, an entry by name, and every entry.
Composer = Callable[
    [
        str,
        Callable[[str], EngineSpec],
        Callable[[str], "EngineEntry | None"],
        Callable[[], Iterable[EngineEntry]],
    ],
    "EngineSpec | None",
]


class EngineCatalog:
    """The engines `parse_engine` knows, in display order: the entries given, then what
    `extensions` adds, read the first time the catalog is used (so that a plugin importing
    larql finds it whole)."""

    def __init__(
        self,
        entries: Sequence[EngineEntry] = (),
        extensions: Extensions | None = None,
        composer: Composer | None = None,
    ) -> None:
        self._composer = composer
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

    def default_specs(self, suite: str) -> list[str]:
        """What a harness runs when given no engines: every entry's `sweeps` of `suite`
        (`bench`, `accuracy`, `longctx`), in catalog order."""
        return [spec for e in self.entries for spec in e.sweeps.specs(e.name, suite)]

    def supported_message(self) -> str:
        return "supported: " + ", ".join(self.supported_names())

    def parse(self, spec: str, policy: SpecPolicy | None = None) -> EngineSpec:
        """`spec` → what it names; `policy` says who wrote it (None: the operator)."""
        try:
            return self._parse(spec, policy or SpecPolicy(), 0)
        except MalformedEngineSpec as e:
            raise type(e)(f"{e} ({self.supported_message()})") from None

    def _parse(self, spec: str, policy: SpecPolicy, depth: int) -> EngineSpec:
        self._extend()
        if self._composer is not None and "+" in spec:
            composed = self._composer(
                spec,
                lambda half: self._parse(half, policy, depth + 1),
                self._by_name.get,
                lambda: self.entries,
            )
            if composed is not None:
                return composed
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
            admit=lambda param, value: self._admit(entry, param, value, policy, depth),
        )
        for param in entry.params:  # a spec left at its default is an EngineSpec too
            if param.kind == "spec" and isinstance(params[param.name], str):
                params[param.name] = self._parse_nested(
                    entry, param, params[param.name], policy, depth
                )
        return EngineSpec(entry, params)

    def _admit(
        self, entry: EngineEntry, param: Param, value: Any, policy: SpecPolicy, depth: int
    ) -> Any:
        policy.admit(entry.name, param, value)
        if param.kind == "spec" and value is not None:
            return self._parse_nested(entry, param, value, policy, depth)
        return value

    def _parse_nested(
        self, entry: EngineEntry, param: Param, spec: str, policy: SpecPolicy, depth: int
    ) -> EngineSpec:
        """A spec parameter's engine, under the same policy, one level deeper."""
        if depth + 1 >= MAX_SPEC_DEPTH:
            raise MalformedEngineSpec(
                f"{entry.name}: {param.name} nests engines more than {MAX_SPEC_DEPTH} deep"
            )
        if depth > 0:  # the outermost wrapper says where the error is
            return self._parse(spec, policy, depth + 1)
        try:
            return self._parse(spec, policy, depth + 1)
        except EngineSpecError as e:
            raise type(e)(f"{e} (in {entry.name}'s {param.name})") from None

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
