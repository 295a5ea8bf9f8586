"""RoPE as data: `RopeSpec` (one layer's rotary embedding) and the inverse frequencies of every
scaling larql reads from model files, in float64.

Two scalings depend on the length of the sequence a forward pass covers, not only on the
position: `dynamic` (NTK: the base grows once the sequence is longer than the model's context)
and `longrope` (one set of per-frequency factors up to the pretraining context, another past it).
For them the frequencies take `lengths`, one per row; `larql.inference.rope` decides which
length a row is rotated at (see `RopeTable`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from larql.models.errors import ModelFormatError

RopeScaling = Literal["default", "linear", "llama3", "yarn", "longrope", "dynamic", "proportional"]
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
    # proportional (Gemma 4's global layers): only the first `rotated_pairs` frequencies turn,
    # the others are 0 (those coordinates pass through), over the whole head width
    rotated_pairs: int | None = None

    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies depend on the sequence length (past `original_max_positions`)."""
        return self.scaling in ("dynamic", "longrope")

    def inv_freq(self, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse frequencies in float64: [rotary_dim // 2] for a sequence within the context,
        [n, rotary_dim // 2] for sequences of `lengths` [n] tokens."""
        return inverse_frequencies(self, lengths)


def check_rope(spec: RopeSpec, head_dim: int) -> None:
    """Refuse RoPE settings read from a file that the frequencies cannot be computed from (a
    `ModelFormatError` saying which)."""
    finite = all(
        math.isfinite(v)
        for v in (
            spec.base,
            spec.factor,
            spec.low_freq_factor,
            spec.high_freq_factor,
            spec.attention_factor,
            spec.beta_fast,
            spec.beta_slow,
        )
    )
    problem = None
    if not finite:
        problem = "a setting is not a finite number"
    elif spec.base <= 1:
        problem = f"the base (rope_theta) {spec.base} is not above 1"
    elif not 2 <= spec.rotary_dim <= head_dim or spec.rotary_dim % 2:
        problem = f"the rotary width {spec.rotary_dim} is not an even number in 2..{head_dim}"
    elif spec.scaling == "dynamic" and spec.rotary_dim < 4:
        problem = "dynamic scaling needs a rotary width of at least 4"
    elif spec.factor <= 0 or spec.beta_fast <= 0 or spec.beta_slow <= 0:
        problem = "the scaling factor and the YaRN betas must be positive"
    elif spec.original_max_positions < 2:
        problem = f"the original context {spec.original_max_positions} is below 2"
    for name in ("freq_divisors", "short_factor", "long_factor"):
        values = getattr(spec, name)
        if problem is None and values is not None and len(values) != spec.rotary_dim // 2:
            problem = (
                f"{name} has {len(values)} values, not rotary width / 2 = {spec.rotary_dim // 2}"
            )
    if problem is not None:
        raise ModelFormatError(f"RoPE ({spec.scaling}): {problem}")


def inverse_frequencies(spec: RopeSpec, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Frequencies of a forward pass over a sequence of `lengths[i]` tokens.

    lengths: [n] (any dtype) or None (a sequence no longer than the model's context) →
    [n, rotary_dim/2] float64, or [rotary_dim/2] without lengths."""
    if lengths is None:
        return inverse_frequencies(spec, torch.tensor([spec.original_max_positions]))[0]
    exponents = torch.arange(0, spec.rotary_dim, 2, dtype=torch.float64) / spec.rotary_dim
    if spec.scaling == "dynamic":
        inv = _dynamic_ntk(spec, exponents, lengths)
    elif spec.scaling == "longrope":
        inv = _longrope(spec, exponents, lengths)
    else:
        inv = _length_free(spec, exponents).expand(lengths.shape[0], -1)
    if spec.freq_divisors is not None:
        inv = inv / torch.tensor(spec.freq_divisors, dtype=torch.float64)
    return inv


def _length_free(spec: RopeSpec, exponents: torch.Tensor) -> torch.Tensor:
    inv = 1.0 / (spec.base**exponents)  # [rotary_dim/2]
    if spec.scaling == "linear":
        return inv / spec.factor
    if spec.scaling == "llama3":
        return _llama3(inv, spec)
    if spec.scaling == "yarn":
        return _yarn(spec, exponents)
    if spec.scaling == "proportional":
        turning = torch.arange(inv.shape[0]) < (spec.rotated_pairs or 0)
        return torch.where(turning, inv, 0.0) / spec.factor
    return inv


def _llama3(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    # Llama 3.1 rule: long wavelengths divided by `factor`, short ones kept, a smooth ramp between.
    low_wavelen = rope.original_max_positions / rope.low_freq_factor
    high_wavelen = rope.original_max_positions / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_positions / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(spec: RopeSpec, exponents: torch.Tensor) -> torch.Tensor:
    # YaRN: frequencies that turn fewer than `beta_slow` times over the pretraining context are
    # interpolated (÷ factor), those that turn more than `beta_fast` times are kept, with a linear
    # ramp over the frequency index between the two.
    half = spec.rotary_dim // 2
    extrapolated = 1.0 / (spec.base**exponents)  # [half]
    interpolated = extrapolated / spec.factor
    low = _yarn_index(spec, spec.beta_fast)
    high = _yarn_index(spec, spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, spec.rotary_dim - 1)
    if low == high:
        high += 0.001  # a one-index ramp would divide by zero
    ramp = ((torch.arange(half, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return interpolated * ramp + extrapolated * (1 - ramp)


def _yarn_index(spec: RopeSpec, rotations: float) -> float:
    """The (fractional) frequency index that turns `rotations` times over the original context."""
    turns = spec.original_max_positions / (rotations * 2 * math.pi)
    return spec.rotary_dim * math.log(turns) / (2 * math.log(spec.base))


def _dynamic_ntk(spec: RopeSpec, exponents: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    # The base grows with the sequence past `original_max_positions` (the model's context):
    # base · (factor·L/context − (factor − 1))^(d/(d−2)); at L ≤ context it is the base itself.
    context = spec.original_max_positions
    length = lengths.to(torch.float64).clamp(min=context).unsqueeze(1)  # [n, 1]
    growth = (spec.factor * length / context - (spec.factor - 1)) ** (
        spec.rotary_dim / (spec.rotary_dim - 2)
    )
    return 1.0 / (spec.base * growth) ** exponents  # [n, rotary_dim/2]


def _longrope(spec: RopeSpec, exponents: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    # Each frequency divided by its own factor: the short set for sequences up to the pretraining
    # context, the long set past it (the whole sequence switches, not the positions past it).
    assert spec.short_factor is not None and spec.long_factor is not None
    base = spec.base**exponents  # [rotary_dim/2]
    short = 1.0 / (torch.tensor(spec.short_factor, dtype=torch.float64) * base)
    long = 1.0 / (torch.tensor(spec.long_factor, dtype=torch.float64) * base)
    is_long = (lengths > spec.original_max_positions).unsqueeze(1)  # [n, 1]
    return torch.where(is_long, long, short)  # [n, rotary_dim/2]


def yarn_attention_factor(
    factor: float, mscale: float | None = None, mscale_all_dim: float | None = None
) -> float:
    """YaRN's default attention factor: 0.1·ln(factor) + 1, or the ratio of two such terms
    weighted by `mscale` and `mscale_all_dim` where a config gives both."""

    def weighted(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if mscale and mscale_all_dim:
        return weighted(mscale) / weighted(mscale_all_dim)
    return weighted(1.0)


def longrope_attention_factor(factor: float, original_max_positions: int) -> float:
    """LongRoPE's default attention factor: √(1 + ln(factor) / ln(original context))."""
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original_max_positions))
