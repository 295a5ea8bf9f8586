"""An HF config's RoPE parameters → `RopeSpec`, for every scaling larql implements.

The parameters come either from `rope_parameters` (transformers 5, per layer type where the
model has several) or from `rope_scaling` + `rope_theta` (transformers 4); the scaling's name
is under `rope_type` or, in older configs, `type`. The defaults follow transformers: a missing
`original_max_position_embeddings` is the top-level one if the config has it (Phi-3 keeps it
there), else `max_position_embeddings`; yarn's and longrope's attention factors are derived from
`factor` when not given.
"""

from __future__ import annotations

import math
from typing import Any

from larql.models.config import ROPE_SCALINGS, RopeSpec
from larql.models.errors import ModelFormatError, UnsupportedArchitecture
from larql.models.fields import MAX_CONTEXT, Fields, show
from larql.models.rope import check_rope, longrope_attention_factor, yarn_attention_factor


def rope_spec(params: dict[str, Any], raw: dict[str, Any], head_dim: int) -> RopeSpec:
    """params: one layer type's RoPE parameters; raw: the whole config (its defaults). The
    result is checked (`check_rope`): a file's settings the frequencies cannot be computed from
    are refused."""
    spec = _rope_spec(params, raw, head_dim)
    check_rope(spec, head_dim)
    return spec


def _rope_spec(params: dict[str, Any], raw: dict[str, Any], head_dim: int) -> RopeSpec:
    p, whole = Fields(params, "rope_parameters."), Fields(raw)
    kind = p.raw("rope_type") or p.raw("type") or "default"
    if kind not in ROPE_SCALINGS:
        raise UnsupportedArchitecture(
            f"RoPE type {show(kind)} is not supported (supported: {', '.join(ROPE_SCALINGS)})"
        )
    fraction = _own_or_config(p, whole, "partial_rotary_factor", 1.0)
    if not 0 < fraction <= 1:
        raise ModelFormatError(f"partial_rotary_factor {fraction} is not in (0, 1]")
    rotary_dim = int(head_dim * fraction)
    base = _own_or_config(p, whole, "rope_theta", 10_000.0)
    if kind == "proportional":  # the whole width, its first fraction of the pairs turning
        factor = p.number("factor", 1.0)
        pairs = int(fraction * head_dim // 2)
        return RopeSpec(base, head_dim, "proportional", factor, rotated_pairs=pairs)
    if kind == "default":
        return RopeSpec(base=base, rotary_dim=rotary_dim)
    if kind == "linear":
        return RopeSpec(base, rotary_dim, "linear", _number(params, "factor", kind))
    if kind == "dynamic":
        context = whole.integer("max_position_embeddings", 2048, low=1, high=MAX_CONTEXT)
        factor = _number(params, "factor", kind)
        return RopeSpec(base, rotary_dim, "dynamic", factor, original_max_positions=context)
    original = _original_context(p, whole)
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
    extended = whole.integer("max_position_embeddings", original, low=1, high=MAX_CONTEXT)
    factor = p.number("factor", extended / original, positive=True)
    if kind == "yarn":
        return _yarn(p, base, rotary_dim, factor, original)
    return _longrope(params, p, base, rotary_dim, factor, original)


def rope_context(layers_rope: list[RopeSpec], max_positions: int) -> int:
    """The context a model decodes to: dynamic NTK extends max_position_embeddings by its
    factor (it exists to run past it); every other scaling states its context as
    max_position_embeddings already."""
    factors = [spec.factor for spec in layers_rope if spec.scaling == "dynamic"]
    context = int(max_positions * max(factors)) if factors else max_positions
    if context > MAX_CONTEXT:
        raise ModelFormatError(
            f"max_position_embeddings {max_positions} × the dynamic RoPE factor is past the "
            f"largest context larql takes ({MAX_CONTEXT})"
        )
    return context


def _yarn(p: Fields, base: float, rotary_dim: int, factor: float, original: int) -> RopeSpec:
    attention = p.optional_number("attention_factor")
    if attention is None:
        mscale = p.optional_number("mscale")
        mscale_all_dim = p.optional_number("mscale_all_dim")
        try:
            attention = yarn_attention_factor(factor, mscale, mscale_all_dim)
        except ZeroDivisionError:
            raise ModelFormatError("YaRN's mscale_all_dim gives an attention factor of 0") from None
    return RopeSpec(
        base,
        rotary_dim,
        "yarn",
        factor,
        original_max_positions=original,
        attention_factor=attention,
        # a zero or missing beta takes its default, as in transformers
        beta_fast=p.number("beta_fast", 0.0) or 32.0,
        beta_slow=p.number("beta_slow", 0.0) or 1.0,
        truncate=p.flag("truncate", True),
    )


def _longrope(
    params: dict[str, Any], p: Fields, base: float, rotary_dim: int, factor: float, original: int
) -> RopeSpec:
    short = _factors(params, "short_factor", rotary_dim)
    long = _factors(params, "long_factor", rotary_dim)
    attention = p.optional_number("attention_factor")
    if attention is None:
        attention = longrope_attention_factor(factor, original)
    return RopeSpec(
        base,
        rotary_dim,
        "longrope",
        factor,
        original_max_positions=original,
        attention_factor=attention,
        short_factor=short,
        long_factor=long,
    )


def _own_or_config(p: Fields, whole: Fields, key: str, default: float) -> float:
    """A number of the RoPE parameters, else of the whole config, else `default`."""
    own = p.optional_number(key)
    return own if own is not None else whole.number(key, default)


def _original_context(p: Fields, whole: Fields) -> int:
    """The pretraining context: the top-level `original_max_position_embeddings`, else the
    parameters', else `max_position_embeddings`."""
    key = "original_max_position_embeddings"
    if whole.has(key):
        return whole.integer(key, low=2, high=MAX_CONTEXT)
    if p.has(key):
        return p.integer(key, low=2, high=MAX_CONTEXT)
    return whole.integer("max_position_embeddings", 2048, low=2, high=MAX_CONTEXT)


def _number(params: dict[str, Any], key: str, kind: str) -> float:
    value = params.get(key)
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ModelFormatError(
            f"RoPE type {kind!r} needs a positive number {key!r}, got {show(value)}"
        )
    return float(value)


def _factors(params: dict[str, Any], key: str, rotary_dim: int) -> tuple[float, ...]:
    values = params.get(key)
    if (
        not isinstance(values, list)
        or len(values) != rotary_dim // 2
        or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    ):
        raise ModelFormatError(
            f"RoPE type 'longrope' needs {key!r}: a list of {rotary_dim // 2} numbers "
            f"(rotary_dim / 2), got {show(values)}"
        )
    return tuple(float(v) for v in values)
