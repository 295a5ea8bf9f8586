"""Which FFN backend runs on which layer: the `FfnLayerPolicy` grammar.

    dense | walk[:k=N|none] | null | remote-walk:endpoint=URL[,wire=f32|f16|i8]   (all layers)
    {walk:k=100}@layers=14-27;{dense}@otherwise                                  (per layer)

A binding is `{backend}@predicate`; predicates are `all`, `otherwise` and
`layers=A-B[,C-D…]` (inclusive ranges; a single layer is `5-5`). Explicit layer bindings may
not overlap, `@otherwise` appears at most once and never alone. `validate_for(num_layers)`
checks the ranges against the model's depth and, without `@all`/`@otherwise`, that every layer
is bound; the validated policy builds a `LayerFfnRouter`, one backend per layer.

Every way a spec can be wrong is its own `FfnPolicyError` subclass whose message quotes the
offending part (the backend errors live in `spec`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from larql.inference.errors import InvariantViolation
from larql.inference.ffn.backend import DenseFfn, FfnBackend, NullFfn
from larql.inference.ffn.spec import (
    EmptySpec,
    FfnPolicyError,
    FfnSpec,
    MalformedBackend,
    UnknownBackend,
)
from larql.inference.ffn.walk import WalkFfn
from larql.models.blocks import BlockRows
from larql.models.model import Model
from larql.specs import split_specs as split_list

__all__ = [
    "EmptySpec",
    "FfnLayerPolicy",
    "FfnPolicyError",
    "FfnSpec",
    "LayerFfnRouter",
    "LayerOutOfRange",
    "LayerUnbound",
    "MalformedBackend",
    "MalformedBraces",
    "MissingPredicate",
    "MultipleOtherwise",
    "OtherwiseAsOnlyBinding",
    "OverlappingLayers",
    "RouterLayerMismatch",
    "RoutingPredicate",
    "UnknownBackend",
    "UnknownPredicate",
    "ValidatedFfnLayerPolicy",
    "split_specs",
]

GRAMMAR = "{backend}@all | {backend}@otherwise | {backend}@layers=A-B[,C-D…] joined by ';'"


class MalformedBraces(FfnPolicyError):
    """A binding that is not `{backend}@predicate` (unbalanced, nested or stray braces)."""


class MissingPredicate(FfnPolicyError):
    """`{backend}` with no `@predicate` after it."""


class UnknownPredicate(FfnPolicyError):
    """A predicate other than all / otherwise / layers=A-B[,C-D…] (a bare `layers=5` too)."""


class OverlappingLayers(FfnPolicyError):
    def __init__(self, message: str, layer: int) -> None:
        super().__init__(message)
        self.layer = layer


class MultipleOtherwise(FfnPolicyError):
    """More than one `@otherwise` binding."""


class OtherwiseAsOnlyBinding(FfnPolicyError):
    """`@otherwise` with nothing for it to be the otherwise of."""


class LayerOutOfRange(FfnPolicyError):
    def __init__(self, message: str, layer: int, num_layers: int) -> None:
        super().__init__(message)
        self.layer, self.num_layers = layer, num_layers


class LayerUnbound(FfnPolicyError):
    def __init__(self, message: str, layer: int) -> None:
        super().__init__(message)
        self.layer = layer


class RouterLayerMismatch(FfnPolicyError):
    """A policy validated for one depth, built for a model of another."""


# ---------------------------------------------------------------------------- predicates

_RANGE = re.compile(r"\s*([0-9]+)\s*-\s*([0-9]+)\s*")


@dataclass(frozen=True)
class RoutingPredicate:
    kind: Literal["all", "otherwise", "layers"]
    ranges: tuple[tuple[int, int], ...] = ()  # half-open [start, end), from inclusive A-B

    @classmethod
    def parse(cls, text: str, binding: str) -> RoutingPredicate:
        name = text.strip().lower()
        if name in ("all", "otherwise"):
            return cls(name)  # type: ignore[arg-type]
        key, eq, value = text.partition("=")
        if not eq or key.strip().lower() != "layers":
            raise UnknownPredicate(
                f"unknown predicate @{text.strip()} in `{binding}`; "
                "accepted: @all, @otherwise, @layers=A-B[,C-D…]"
            )
        ranges = []
        for piece in value.split(","):
            match = _RANGE.fullmatch(piece)
            if match is None:
                raise UnknownPredicate(
                    f"bad layer range {piece.strip()!r} in `{binding}`; write inclusive ranges "
                    "A-B (a single layer is 5-5)"
                )
            start, end = int(match[1]), int(match[2])
            if end < start:
                raise UnknownPredicate(
                    f"layer range {start}-{end} in `{binding}` ends before it starts"
                )
            ranges.append((start, end + 1))
        return cls("layers", tuple(ranges))

    def spec(self) -> str:
        if self.kind != "layers":
            return self.kind
        return "layers=" + ",".join(f"{a}-{b - 1}" for a, b in self.ranges)


@dataclass(frozen=True)
class Binding:
    backend: FfnSpec
    predicate: RoutingPredicate
    text: str = field(default="", compare=False)  # as written, for messages

    def spec(self) -> str:
        return f"{{{self.backend.spec()}}}@{self.predicate.spec()}"


# ---------------------------------------------------------------------------- the policy


@dataclass(frozen=True)
class FfnLayerPolicy:
    bindings: tuple[Binding, ...]

    @classmethod
    def from_spec(cls, spec: str) -> FfnLayerPolicy:
        text = spec.strip()
        if not text:
            raise EmptySpec("the FFN policy is empty; e.g. dense, walk:k=100 or " + GRAMMAR)
        if "{" not in text:
            if "}" in text:
                raise MalformedBraces(f"`{text}` has a '}}' without a '{{'; bindings are {GRAMMAR}")
            return cls((Binding(FfnSpec.parse(text), RoutingPredicate("all"), text),))
        bindings = tuple(_parse_binding(piece.strip()) for piece in text.split(";"))
        _check_bindings(bindings)
        return cls(bindings)

    def spec(self) -> str:
        """Canonical spec; parsing it gives back an equal policy."""
        if len(self.bindings) == 1 and self.bindings[0].predicate.kind == "all":
            return self.bindings[0].backend.spec()
        return ";".join(b.spec() for b in self.bindings)

    def validate_for(self, num_layers: int) -> ValidatedFfnLayerPolicy:
        for b in self.bindings:
            for _, end in b.predicate.ranges:
                if end > num_layers:
                    raise LayerOutOfRange(
                        f"`{b.text}` binds layer {end - 1}, but the model has {num_layers} "
                        f"layers (0-{num_layers - 1})",
                        end - 1,
                        num_layers,
                    )
        if not any(b.predicate.kind in ("all", "otherwise") for b in self.bindings):
            claimed = sorted(r for b in self.bindings for r in b.predicate.ranges)
            layer = 0
            for start, end in claimed:
                if start > layer:
                    break
                layer = max(layer, end)
            if layer < num_layers:
                raise LayerUnbound(
                    f"layer {layer} is bound by no binding of `{self.spec()}`; add "
                    "{backend}@otherwise or cover layers 0-" + f"{num_layers - 1}",
                    layer,
                )
        return ValidatedFfnLayerPolicy(self, num_layers)


def _parse_binding(piece: str) -> Binding:
    if not piece:
        raise MalformedBraces(f"empty binding between ';'; bindings are {GRAMMAR}")
    close = piece.find("}")
    if not piece.startswith("{") or close < 0:
        raise MalformedBraces(f"`{piece}` is not {{backend}}@predicate")
    inner, rest = piece[1:close], piece[close + 1 :].strip()
    if "{" in inner or "{" in rest or "}" in rest:
        raise MalformedBraces(f"`{piece}` has nested or stray braces; bindings are {GRAMMAR}")
    if not inner.strip():
        raise MalformedBraces(f"`{piece}` names no backend inside the braces")
    if not rest.startswith("@") or not rest[1:].strip():
        shown = f", found {rest!r}" if rest else ""
        raise MissingPredicate(
            f"`{piece}` needs a predicate after the braces{shown}: @all, @otherwise or @layers=A-B"
        )
    backend = FfnSpec.parse(inner, context=piece)
    return Binding(backend, RoutingPredicate.parse(rest[1:], piece), piece)


def _check_bindings(bindings: Sequence[Binding]) -> None:
    otherwise = [b for b in bindings if b.predicate.kind == "otherwise"]
    if len(otherwise) > 1:
        raise MultipleOtherwise(
            f"@otherwise appears {len(otherwise)} times (`{otherwise[0].text}`, "
            f"`{otherwise[1].text}`); at most one binding may be the fallback"
        )
    if len(bindings) == 1 and otherwise:
        raise OtherwiseAsOnlyBinding(
            f"`{otherwise[0].text}` is the only binding; write {{backend}}@all (or the bare "
            "backend) to use one backend everywhere"
        )
    everywhere = [b for b in bindings if b.predicate.kind == "all"]
    if len(everywhere) > 1:
        raise OverlappingLayers(
            f"`{everywhere[0].text}` and `{everywhere[1].text}` both bind every layer", 0
        )
    # Sorted by start, the first claim that starts before the furthest end so far is the
    # lowest layer bound twice.
    claims = sorted((start, end, b.text) for b in bindings for start, end in b.predicate.ranges)
    reach, owner = -1, ""
    for start, end, text in claims:
        if start < reach:
            where = f"`{owner}`" + ("" if owner == text else f" and `{text}`")
            raise OverlappingLayers(f"layer {start} is bound twice, by {where}", start)
        if end > reach:
            reach, owner = end, text


# ---------------------------------------------------------------------------- validated + router


class ValidatedFfnLayerPolicy:
    """A policy known to bind every layer of a `num_layers`-deep model exactly once."""

    def __init__(self, policy: FfnLayerPolicy, num_layers: int) -> None:
        self.policy = policy
        self.num_layers = num_layers

    def spec(self) -> str:
        return self.policy.spec()

    def expand_to_layers(self) -> list[FfnSpec]:
        """One backend kind per layer: explicit layers first, then @all, then @otherwise."""
        slots: list[FfnSpec | None] = [None] * self.num_layers
        for b in self.policy.bindings:
            for start, end in b.predicate.ranges:
                slots[start:end] = [b.backend] * (end - start)
        for kind in ("all", "otherwise"):
            for b in self.policy.bindings:
                if b.predicate.kind == kind:
                    slots = [b.backend if s is None else s for s in slots]
        assert all(s is not None for s in slots), "validate_for guarantees full coverage"
        return slots  # type: ignore[return-value]

    def build_router(self, model: Model, remote_timeout_s: float = 60.0) -> LayerFfnRouter:
        """One backend per layer; layers bound to the same backend share one instance (one
        keep-alive HTTP client per remote endpoint)."""
        if model.config.num_layers != self.num_layers:
            raise RouterLayerMismatch(
                f"FFN policy `{self.spec()}` was validated for {self.num_layers} layers; "
                f"{model.name} has {model.config.num_layers}"
            )
        built: dict[FfnSpec, FfnBackend] = {}
        for spec in self.expand_to_layers():
            if spec not in built:
                built[spec] = _build_backend(spec, model, remote_timeout_s)
        layers = self.expand_to_layers()
        for spec, backend in built.items():
            if spec.dispatch == "batch":  # a remote-walk asked for its layers in one request
                backend.layers = [i for i, s in enumerate(layers) if s == spec]  # type: ignore[attr-defined]
        return LayerFfnRouter([built[k] for k in layers], self.spec())


def _build_backend(spec: FfnSpec, model: Model, remote_timeout_s: float) -> FfnBackend:
    if spec.name == "dense":
        return DenseFfn(model)
    if spec.name == "walk":
        return WalkFfn(model, spec.k)
    if spec.name == "null":
        return NullFfn()
    from larql.inference.ffn.remote import RemoteWalkFfn  # httpx only when a policy asks

    if spec.name == "remote-experts":
        return _remote_experts(spec, model, remote_timeout_s)
    assert spec.endpoint is not None
    return RemoteWalkFfn(
        spec.endpoint,
        wire=spec.wire,  # None: the best wire both sides speak
        hidden_size=model.config.hidden_size,
        read_timeout_s=spec.timeout if spec.timeout is not None else remote_timeout_s,
        dispatch=spec.dispatch or "streaming",
    )


def _remote_experts(spec: FfnSpec, model: Model, remote_timeout_s: float) -> FfnBackend:
    from larql.inference.ffn.remote import RemoteWalkFfn
    from larql.inference.ffn.remote_experts import ExpertShard, RemoteExpertsFfn, parse_moe_shards

    assert spec.shards is not None
    shards = [
        ExpertShard(
            experts,
            RemoteWalkFfn(
                url,
                wire=spec.wire,
                hidden_size=model.config.hidden_size,
                read_timeout_s=spec.timeout if spec.timeout is not None else remote_timeout_s,
            ),
        )
        for experts, url in parse_moe_shards(spec.shards)
    ]
    try:
        return RemoteExpertsFfn(model, shards, spec.spec())
    except ValueError as e:
        raise MalformedBackend(f"{spec.spec()}: {e}") from None


class LayerFfnRouter(FfnBackend):
    """An `FfnBackend` that hands each layer to the backend its policy binds there."""

    def __init__(self, backends: Sequence[FfnBackend], name: str) -> None:
        self.backends = list(backends)
        self.name = name

    def backend_for(self, layer: int) -> FfnBackend:
        if not 0 <= layer < len(self.backends):
            raise InvariantViolation(
                f"FFN router `{self.name}` has {len(self.backends)} layers; got layer {layer}"
            )
        return self.backends[layer]

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.backend_for(layer).forward(layer, x)

    def parallel_experts(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return self.backend_for(layer).parallel_experts(layer, h)

    def fused_block(
        self, layer: int, h: torch.Tensor, norm: torch.Tensor, eps: float
    ) -> torch.Tensor | None:
        return self.backend_for(layer).fused_block(layer, h, norm, eps)

    def silu_blocks(self, layer: int) -> tuple[BlockRows, BlockRows] | None:
        return self.backend_for(layer).silu_blocks(layer)

    @property
    def graph_safe(self) -> bool:  # type: ignore[override]
        return all(b.graph_safe for b in self.backends)

    def wire_bytes(self) -> int:
        return sum(b.wire_bytes() for b in {id(b): b for b in self.backends}.values())

    def kinds(self) -> frozenset[str]:
        return frozenset().union(*(b.kinds() for b in self.backends))

    def close(self) -> None:
        """Close remote clients (their keep-alive connections)."""
        for backend in {id(b): b for b in self.backends}.values():
            backend.close()


# ---------------------------------------------------------------------------- lists


def split_specs(specs: str) -> list[str]:
    """Split a list of policies on commas outside braces (a policy's own `;` and braced
    commas stay). A piece that does not parse on its own and reads as a continuation
    (`wire=f16` after a remote-walk, `28-33` after a layer range) is glued back onto the
    policy before it."""
    return split_list(specs, _parses, semicolons=False)


def _parses(spec: str) -> bool:
    try:
        FfnLayerPolicy.from_spec(spec)
    except FfnPolicyError:
        return False
    return True


def build_ffn(model: Model, spec: str = "dense") -> LayerFfnRouter:
    """The FFN a policy spec names (`dense`, `walk:k=100`,
    `{walk:k=100}@layers=14-27;{dense}@otherwise`, …), validated against the model's depth
    and built as a per-layer router. Errors are the typed `FfnPolicyError`s above."""
    return FfnLayerPolicy.from_spec(spec).validate_for(model.config.num_layers).build_router(model)
