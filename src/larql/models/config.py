"""What a model is, as data: `Arch` (how a layer computes), `LayerSpec` (per-layer attention span
and RoPE), `ModelConfig` (dimensions plus both). The forward pass reads these and never branches
on an architecture's name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from larql.models.rope_scaling import inverse_frequencies

Activation = Literal["silu", "gelu_tanh", "gelu"]
RopeScaling = Literal["default", "linear", "llama3", "yarn", "longrope", "dynamic"]
ROPE_SCALINGS: tuple[RopeScaling, ...] = get_args(RopeScaling)


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer: split-half ("rotate-half") pairs over the first
    `rotary_dim` dimensions of each head.

    `dynamic` and `longrope` frequencies depend on the length of the sequence a forward pass
    covers (`length_dependent`); `larql.inference.rope` documents which length each row is
    rotated at."""

    base: float
    rotary_dim: int
    scaling: RopeScaling = "default"
    factor: float = 1.0
    # llama3 scaling only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3, yarn, longrope: the pretraining context; dynamic: the context past which the
    # base grows (the config's max_position_embeddings)
    original_max_positions: int = 8192
    # per-frequency divisors (GGUF `rope_freqs.weight`), applied after scaling
    freq_divisors: tuple[float, ...] | None = None
    # multiplies cos and sin, so q·k by its square (yarn, longrope)
    attention_factor: float = 1.0
    # yarn: the ramp between interpolated and kept frequencies, in turns over the context
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # longrope: per-frequency divisors up to the pretraining context, and past it
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies depend on the sequence length (past `original_max_positions`)."""
        return self.scaling in ("dynamic", "longrope")

    def inv_freq(self, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse frequencies in float64: [rotary_dim // 2] for a sequence within the context,
        [n, rotary_dim // 2] for sequences of `lengths` [n] tokens."""
        return inverse_frequencies(self, lengths)


@dataclass(frozen=True)
class Arch:
    """How every layer of an architecture computes (the same for all its layers)."""

    name: str
    activation: Activation = "silu"
    # Norm weights are stored as multipliers; `norm_offset` records what was folded in at load
    # time (Gemma stores w and computes x̂·(1+w)).
    norm_offset: float = 0.0
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False  # norms after attention and after the FFN (Gemma 2/3 sandwich)
    attn_softcap: float | None = None  # cap·tanh(score/cap) before the softmax (Gemma 2)
    final_softcap: float | None = None  # cap·tanh(logit/cap) (Gemma 2)
    scale_embeddings: bool = False  # embeddings × √hidden (Gemma)
    # Whether the layer state is a function of (pre-layer residual, absolute position) only; an
    # engine that stores residuals instead of K/V relies on it.
    residual_is_sufficient: bool = True


@dataclass(frozen=True)
class LayerSpec:
    """Per-layer attention: `sliding_window` keys including the current one (None = full)."""

    sliding_window: int | None
    rope: RopeSpec


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
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if len(self.layers) != self.num_layers:
            raise ValueError(f"{len(self.layers)} layer specs for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads not divisible by {self.num_kv_heads}")

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size) if self.arch.scale_embeddings else 1.0

    def sliding_window(self, layer: int) -> int | None:
        return self.layers[layer].sliding_window

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """K+V bytes one token costs in a full cache over all layers (fp16 by default)."""
        return self.num_layers * self.kv_dim * 2 * bytes_per_element


def uniform_layers(
    num_layers: int, rope: RopeSpec, window: int | None = None
) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec(window, rope) for _ in range(num_layers))
