"""An HF config's RoPE parameters → `RopeSpec`, for every scaling larql implements.

The parameters come either from `rope_parameters` (transformers 5, per layer type where the
model has several) or from `rope_scaling` + `rope_theta` (transformers 4); the scaling's name
is under `rope_type` or, in older configs, `type`. The defaults follow transformers: a missing
`original_max_position_embeddings` is the top-level one if the config has it (Phi-3 keeps it
there), else `max_position_embeddings`; yarn's and longrope's attention factors are derived from
`factor` when not given.
"""

from __future__ import annotations

from typing import Any

from larql.models.config import ROPE_SCALINGS, RopeSpec
from larql.models.errors import ModelFormatError, UnsupportedArchitecture
from larql.models.rope import longrope_attention_factor, yarn_attention_factor


def rope_spec(params: dict[str, Any], raw: dict[str, Any], head_dim: int) -> RopeSpec:
    """params: one layer type's RoPE parameters; raw: the whole config (its defaults)."""
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_SCALINGS:
        raise UnsupportedArchitecture(
            f"RoPE type {kind!r} is not supported (supported: {', '.join(ROPE_SCALINGS)})"
        )
    fraction = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * fraction)
    base = float(params.get("rope_theta", raw.get("rope_theta", 10_000.0)))
    if kind == "proportional":  # the whole width, its first fraction of the pairs turning
        factor = float(params.get("factor", 1.0))
        pairs = int(fraction * head_dim // 2)
        return RopeSpec(base, head_dim, "proportional", factor, rotated_pairs=pairs)
    if kind == "default":
        return RopeSpec(base=base, rotary_dim=rotary_dim)
    if kind == "linear":
        return RopeSpec(base, rotary_dim, "linear", _number(params, "factor", kind))
    if kind == "dynamic":
        context = int(raw.get("max_position_embeddings", 2048))
        factor = _number(params, "factor", kind)
        return RopeSpec(base, rotary_dim, "dynamic", factor, original_max_positions=context)
    original = _original_context(params, raw)
    if kind == "llama3":
        return RopeSpec(
            base,
            rotary_dim,
            "llama3",
            _number(params, "factor", kind),
            low_freq_factor=_number(params, "low_freq_factor", kind),
            high_freq_factor=_number(params, "high_freq_factor", kind),
            original_max_positions=original,
        )
    # yarn and longrope: a missing factor is the ratio of the extended to the original context
    factor = params.get("factor")
    if factor is None:
        factor = int(raw.get("max_position_embeddings", original)) / original
    if kind == "yarn":
        return _yarn(params, base, rotary_dim, float(factor), original)
    return _longrope(params, base, rotary_dim, float(factor), original)


def rope_context(layers_rope: list[RopeSpec], max_positions: int) -> int:
    """The context a model decodes to: dynamic NTK extends max_position_embeddings by its
    factor (it exists to run past it); every other scaling states its context as
    max_position_embeddings already."""
    factors = [spec.factor for spec in layers_rope if spec.scaling == "dynamic"]
    return int(max_positions * max(factors)) if factors else max_positions


def _yarn(
    params: dict[str, Any], base: float, rotary_dim: int, factor: float, original: int
) -> RopeSpec:
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention = yarn_attention_factor(factor, mscale, mscale_all_dim)
    return RopeSpec(
        base,
        rotary_dim,
        "yarn",
        factor,
        original_max_positions=original,
        attention_factor=float(attention),
        # a zero or missing beta takes its default, as in transformers
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
    )


def _longrope(
    params: dict[str, Any], base: float, rotary_dim: int, factor: float, original: int
) -> RopeSpec:
    short = _factors(params, "short_factor", rotary_dim)
    long = _factors(params, "long_factor", rotary_dim)
    attention = params.get("attention_factor")
    if attention is None:
        attention = longrope_attention_factor(factor, original)
    return RopeSpec(
        base,
        rotary_dim,
        "longrope",
        factor,
        original_max_positions=original,
        attention_factor=float(attention),
        short_factor=short,
        long_factor=long,
    )


def _original_context(params: dict[str, Any], raw: dict[str, Any]) -> int:
    value = raw.get("original_max_position_embeddings")
    if value is None:
        value = params.get("original_max_position_embeddings")
    if value is None:
        value = raw.get("max_position_embeddings", 2048)
    return int(value)


def _number(params: dict[str, Any], key: str, kind: str) -> float:
    value = params.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ModelFormatError(f"RoPE type {kind!r} needs a number {key!r}, got {value!r}")
    return float(value)


def _factors(params: dict[str, Any], key: str, rotary_dim: int) -> tuple[float, ...]:
    values = params.get(key)
    if not isinstance(values, list) or len(values) != rotary_dim // 2:
        raise ModelFormatError(
            f"RoPE type 'longrope' needs {key!r}: a list of {rotary_dim // 2} numbers "
            f"(rotary_dim / 2), got {values!r}"
        )
    return tuple(float(v) for v in values)
