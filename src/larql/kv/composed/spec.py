"""`EVICTION+QUANTISER` specs: an eviction engine whose kept rows a quantiser codes —
`snapkv:budget=256+turbo-quant:bits=4`, or `h2o:keep=0.5+turbo-quant:bits=4` where the policy
goes on evicting as it decodes (the quantiser's store then drops rows: `dropping`). Each half is
a spec of the catalog, parsed under the same policy (so a request's bounds apply to both), and
the pair must be an eviction, then a quantiser; anything else is a `CompositionRefused` naming
what composes.

The quantiser's `recent` window: in a composition an unset `recent` is 0, so every kept row
but the quantiser's sinks is coded and the bytes are the product of the two (kept rows × code
bits); the quantiser alone keeps its newest rows exact (32 at 4 bits; 160 and 128 int8 at 3 and
2), which on an evicted cache of a few hundred rows would hold most of it out of the codes. A
`recent=N` written in the spec is kept."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from larql.inference.engine import Engine
from larql.kv.composed.storage import QuantisedStorage
from larql.kv.eviction.base import EvictingEngine
from larql.kv.spec import (
    EngineEntry,
    EngineSpec,
    EngineSpecError,
    MalformedEngineSpec,
    SpecPolicy,
)
from larql.kv.turbo_quant.engine import TurboQuantEngine
from larql.models.model import Model
from larql.specs import split_name

SEPARATOR = "+"
GRAMMAR = "EVICTION+QUANTISER"
EVICTIONS = ("eviction", "evicts-in-decode")  # the roles of a composition's first half


class CompositionRefused(MalformedEngineSpec):
    """An `A+B` spec whose halves do not compose (or a `+` with no engine after it)."""


@dataclass(frozen=True)
class ComposedSpec(EngineSpec):
    """`eviction+quantiser`: `entry` is the pair's (its name `snapkv+turbo-quant`, no
    parameters of its own); the halves hold the parameters."""

    eviction: EngineSpec
    quantiser: EngineSpec

    def spec(self) -> str:
        return f"{self.eviction.spec()}{SEPARATOR}{self.quantiser.spec()}"

    def check(self, policy: SpecPolicy) -> None:
        self.eviction.check(policy)
        self.quantiser.check(policy)

    def build(self, model: Model | None = None, profiling: bool = False) -> Engine:
        if model is not None:
            self.check(SpecPolicy.operator(model))
        policy = self.eviction.build(model, profiling)
        quantiser = self._quantiser_spec().build(model, profiling)
        assert isinstance(policy, EvictingEngine) and isinstance(quantiser, TurboQuantEngine)
        params = self.eviction.params
        adaptive = params.get("heads") == "adaptive" or params.get("layers") == "adaptive"
        policy.storage = QuantisedStorage(quantiser, adaptive, drops=not policy.compresses_once)
        policy.name = self.entry.name  # type: ignore[misc]  # this engine's name, not the class's
        policy.spec_string = self.spec()
        if self.entry.refuses_ffn:
            policy.refused_ffn = self.entry.refuses_ffn
        return policy

    def _quantiser_spec(self) -> EngineSpec:
        """The quantiser as composed: `recent` 0 unless the spec sets it (module docstring)."""
        if "recent" in self.quantiser.params and self.quantiser.params["recent"] is None:
            return replace(self.quantiser, params={**self.quantiser.params, "recent": 0})
        return self.quantiser


def _unbuilt(params: Mapping[str, Any], model: Model | None) -> Engine:
    raise MalformedEngineSpec("a composed engine is built from its ComposedSpec")


def _role(spec: EngineSpec) -> str:
    """`eviction` (compresses once), `evicts-in-decode` (both compose), `quantiser` or
    `other`."""
    try:
        engine = spec.entry.factory({**spec.params, "profiling": False}, None)
    except EngineSpecError:
        raise  # the half itself is wrong (`h2o:budget=64` with its default recent=256)
    except Exception:  # an engine that needs its model (or files) to exist composes with nothing
        return "other"
    if isinstance(engine, EvictingEngine):
        return "eviction" if engine.compresses_once else "evicts-in-decode"
    return "quantiser" if isinstance(engine, TurboQuantEngine) else "other"


def composable(entries: Iterable[EngineEntry]) -> tuple[list[str], list[str]]:
    """The catalog's engines that compose: (evictions, quantisers), by name."""
    evictions, quantisers = [], []
    for entry in entries:
        role = _role(EngineSpec(entry, {p.name: p.default for p in entry.params}))
        if role in EVICTIONS:
            evictions.append(entry.name)
        elif role == "quantiser":
            quantisers.append(entry.name)
    return evictions, quantisers


def what_composes(entries: Iterable[EngineEntry]) -> str:
    evictions, quantisers = composable(entries)
    return (
        f"{GRAMMAR} composes an eviction ({', '.join(evictions)}) with a "
        f"quantiser ({', '.join(quantisers)})"
    )


def composition_doc(entries: Iterable[EngineEntry]) -> str:
    """What `larql engines` says of composition (docs/ENGINES.md's section)."""
    evictions, quantisers = composable(entries)
    names = ", ".join(f"`{n}`" for n in evictions), ", ".join(f"`{n}`" for n in quantisers)
    return (
        f"`{GRAMMAR}` (e.g. `snapkv:budget=256+turbo-quant:bits=4`) runs an eviction "
        f"({names[0]}) with its kept rows coded by a quantiser ({names[1]}): "
        "the eviction chooses the rows after an exact prefill, the quantiser's own store codes "
        "them and every decoded row, and decode attends through the quantiser's own path, so "
        "the bytes held are the product of the two. On a model with sliding-window layers "
        "(Gemma 3) the eviction chooses rows on the global layers only; each sliding layer "
        "keeps its window in the quantiser's store, coded as the quantiser alone codes it, so "
        "a composition holds fewer bytes than its quantiser alone. "
        "An eviction that evicts while decoding "
        "(`h2o`, `tova`) goes on choosing: each step it scores the rows by the attention over "
        "them as the store holds them (decoded) and the store drops the rows it evicts, "
        "compacting its codes (the quantiser's exact sinks and recent rows are evicted by "
        "the policy's rules as any row), so the rows held stay at its budget (`budget` rows, "
        "or `keep` of the positions seen: `h2o:keep=0.5+turbo-quant:bits=4`); its decode runs the "
        "quantiser's torch path. Each half takes its own parameters (a request's bounds apply "
        "to both); in a composition the quantiser's `recent` is 0 unless "
        "given, so every kept row but its sinks is coded. With `heads=adaptive` each K/V head "
        "keeps its own count of rows, each head's in a store of its own (its own sinks and "
        "mean), so the layer codes exactly the rows its heads kept; decode then reads them "
        "through the quantiser's torch path on every device. On CUDA a compress-once eviction "
        "with one count of rows a layer decodes on the quantiser's own Triton kernels, the "
        "step in a CUDA graph (each layer's stores laid out by its row count, RoPE at the "
        "tokens' positions); its saved state is the torch path's, and reads back onto "
        "either path. In `larql serve` a composed session batches with sessions of the same "
        "composition, parameters and path."
    )


def parse_composed(
    spec: str,
    parse_half: Callable[[str], EngineSpec],
    entry_named: Callable[[str], EngineEntry | None],
    entries: Callable[[], Iterable[EngineEntry]],
) -> ComposedSpec | None:
    """`spec` as `A+B`, or None where it composes nothing (no `+`, or a `+` inside a value of
    an engine that takes paths or names and no engine named after it)."""
    pieces = spec.split(SEPARATOR)
    if len(pieces) == 1:
        return None
    after = [entry_named(split_name(piece)[0].lower()) for piece in pieces[1:]]
    first = entry_named(split_name(pieces[0])[0].lower())
    takes_text = first is not None and any(p.kind != "value" for p in first.params)
    if not any(after) and takes_text:
        return None
    refuse = partial_refusal(entries)
    if any(not piece.strip() for piece in pieces):
        refuse(f"{spec.strip()!r}: '+' needs an engine on each side")
    if len(pieces) > 2:
        refuse(f"{spec.strip()!r} names {len(pieces)} engines")
    eviction, quantiser = parse_half(pieces[0]), parse_half(pieces[1])
    roles = _role(eviction), _role(quantiser)
    if roles[0] == "quantiser" and roles[1] in EVICTIONS:
        refuse(f"{spec.strip()!r}: write the eviction first ({pieces[1]}+{pieces[0]})")
    if roles[0] not in EVICTIONS:
        refuse(f"{eviction.entry.name} is not an eviction engine")
    if roles[1] != "quantiser":
        refuse(f"{quantiser.entry.name} is not a quantiser")
    return ComposedSpec(composed_entry(eviction.entry, quantiser.entry), {}, eviction, quantiser)


def partial_refusal(entries: Callable[[], Iterable[EngineEntry]]) -> Callable[[str], None]:
    def refuse(why: str) -> None:
        raise CompositionRefused(f"{why}; {what_composes(entries())}")

    return refuse


def composed_entry(eviction: EngineEntry, quantiser: EngineEntry) -> EngineEntry:
    """The pair's entry: what it keeps and promises, read from the halves'."""
    return EngineEntry(
        name=f"{eviction.name}{SEPARATOR}{quantiser.name}",
        aliases=(),
        params=(),
        keeps=f"the rows {eviction.name} keeps, coded as {quantiser.name} codes them",
        contract=f"bounded KL vs standard (destructive: {eviction.name}'s eviction, then "
        f"{quantiser.name}'s codes); prefill output exact",
        factory=_unbuilt,
        live_decode=eviction.live_decode and quantiser.live_decode,
        refuses_ffn={**quantiser.refuses_ffn, **eviction.refuses_ffn},
        batching="yes: with sessions of the same composition and parameters (projections and "
        "FFN once for every row, each row attending over its own coded rows)",
    )
