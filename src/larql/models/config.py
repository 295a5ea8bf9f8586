"""What a model is, as data: `Arch` (how a layer computes), `LayerSpec` (per-layer attention span
and RoPE), `ModelConfig` (dimensions plus both). The forward pass reads these and never branches
on an architecture's name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

# RoPE lives in its own module; importers of the model's config find it here too
from larql.models.rope import ROPE_SCALINGS as ROPE_SCALINGS
from larql.models.rope import RopeScaling as RopeScaling
from larql.models.rope import RopeSpec

Activation = Literal["silu", "gelu_tanh", "gelu"]


@dataclass(frozen=True)
class Arch:
    """How every layer of an architecture computes (the same for all its layers)."""

    name: str
    activation: Activation = "silu"
    # Norm weights are stored as multipliers; `norm_offset` records what was folded in at load
    # time (Gemma stores w and computes x̂·(1+w)).
    norm_offset: float = 0.0
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    v_norm: bool = False  # per-head RMSNorm of v without a weight, before it is kept (Gemma 4)
    # a layer without a value projection takes its keys' projection as values, before the key
    # norm and RoPE (Gemma 4's `attention_k_eq_v`, on its global layers)
    keys_as_values: bool = False
    post_norms: bool = False  # norms after attention and after the FFN (Gemma 2/3 sandwich)
    attn_softcap: float | None = None  # cap·tanh(score/cap) before the softmax (Gemma 2)
    # a learned logit per query head beside the keys' in the softmax, its value column zero:
    # attention may go nowhere (GPT-OSS); the weights hold them as `attn_sinks`
    attention_sinks: bool = False
    final_softcap: float | None = None  # cap·tanh(logit/cap) (Gemma 2)
    scale_embeddings: bool = False  # embeddings × √hidden (Gemma)
    # Whether the layer state is a function of (pre-layer residual, absolute position) only; an
    # engine that stores residuals instead of K/V relies on it.
    residual_is_sufficient: bool = True


@dataclass(frozen=True)
class ExpertRouting:
    """How a mixture-of-experts layer picks and weighs its experts: the router's logits → softmax
    over every expert → the `top_k` largest, divided by their sum when `normalize_top_k` (the
    same as GPT-OSS's softmax over the top_k logits); each token's FFN output is Σ weight ·
    expert(x) (+ a shared expert, whose output a sigmoid gate scales where the weights have
    one). An expert is a gated MLP with the model's activation, or with `clamped_swiglu` = (α,
    limit) GPT-OSS's (up + 1) · g·σ(α·g), g = min(gate, limit), up clamped to ±limit.
    `expert_width` / `shared_width`: an expert's and the shared expert's intermediate width
    (what tensor parallelism splits; None: not given, 0: no shared expert)."""

    num_experts: int
    top_k: int
    normalize_top_k: bool
    clamped_swiglu: tuple[float, float] | None = None
    expert_width: int | None = None
    shared_width: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..{self.num_experts} experts")


@dataclass(frozen=True)
class LayerSpec:
    """Per-layer attention: `sliding_window` keys including the current one (None = full);
    a head width and K/V head count of its own where it differs from the model's (Gemma 4's
    global layers); `kv_source`: the earlier layer whose keys and values this one attends over
    instead of its own (Gemma 4's K/V-shared layers keep none; None: its own); an MLP width of
    its own (`intermediate_size`, Gemma 4's double-wide MLP on those layers)."""

    sliding_window: int | None
    rope: RopeSpec
    head_dim: int | None = None
    num_kv_heads: int | None = None
    kv_source: int | None = None
    intermediate_size: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    arch: Arch
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    norm_eps: float
    attn_scale: float
    layers: tuple[LayerSpec, ...] = field(repr=False)
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    experts: ExpertRouting | None = None  # mixture-of-experts layers (those with a router)
    # Granite's embedding multiplier (other scalings of the input: `Arch.scale_embeddings`)
    embedding_multiplier: float = 1.0
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if len(self.layers) != self.num_layers:
            raise ValueError(f"{len(self.layers)} layer specs for {self.num_layers} layers")
        for layer in range(self.num_layers):
            if self.num_heads % self.kv_heads_of(layer):
                kv = self.kv_heads_of(layer)
                raise ValueError(f"{self.num_heads} heads not divisible by {kv} (layer {layer})")
            source = self.kv_source_of(layer)
            if source is not None and not (
                0 <= source < layer
                and self.kv_source_of(source) is None
                and self.head_dim_of(source) == self.head_dim_of(layer)
                and self.kv_heads_of(source) == self.kv_heads_of(layer)
                and self.layers[source].sliding_window == self.layers[layer].sliding_window
            ):
                raise ValueError(
                    f"layer {layer} cannot share layer {source}'s K/V: the source must be an "
                    "earlier layer with K/V of its own, the same head shape and window"
                )

    def head_dim_of(self, layer: int) -> int:
        """Layer `layer`'s head width."""
        return self.layers[layer].head_dim or self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        """Layer `layer`'s K/V heads."""
        return self.layers[layer].num_kv_heads or self.num_kv_heads

    def kv_source_of(self, layer: int) -> int | None:
        """The layer whose K/V `layer` attends over instead of its own (None: its own)."""
        return self.layers[layer].kv_source

    @cached_property  # (asked per layer and step by the compiled decode layer)
    def shares_kv(self) -> bool:
        """Some layer attends over another layer's K/V (and keeps none of its own)."""
        return any(spec.kv_source is not None for spec in self.layers)

    def intermediate_size_of(self, layer: int) -> int:
        """Layer `layer`'s MLP width."""
        return self.layers[layer].intermediate_size or self.intermediate_size

    def q_dim_of(self, layer: int) -> int:
        return self.num_heads * self.head_dim_of(layer)

    def kv_dim_of(self, layer: int) -> int:
        return self.kv_heads_of(layer) * self.head_dim_of(layer)

    @property
    def uniform_attention(self) -> bool:
        """Every layer has the model's head width and K/V heads."""
        return all(spec.head_dim is None and spec.num_kv_heads is None for spec in self.layers)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def embed_scale(self) -> float:
        if self.arch.scale_embeddings:
            return math.sqrt(self.hidden_size)
        return self.embedding_multiplier

    @property
    def experts_per_token(self) -> int:
        """Experts each token runs in a mixture-of-experts layer (0: no experts)."""
        return self.experts.top_k if self.experts is not None else 0

    def sliding_window(self, layer: int) -> int | None:
        return self.layers[layer].sliding_window

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """K+V bytes one token costs in a full cache over all layers (fp16 by default); a layer
        sharing another's K/V costs nothing."""
        kv_dims = sum(
            self.kv_dim_of(layer)
            for layer in range(self.num_layers)
            if self.kv_source_of(layer) is None
        )
        return kv_dims * 2 * bytes_per_element


def uniform_layers(
    num_layers: int, rope: RopeSpec, window: int | None = None
) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec(window, rope) for _ in range(num_layers))
