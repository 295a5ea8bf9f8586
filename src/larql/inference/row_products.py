"""A layer's products with the step before or after them: the norm before a product (and RoPE
after the QKV product), the residual add after one, SiLU(gate) · up before the down product. For
a decode row on CUDA each is one launch (`larql.kernels.gemv`); everywhere else they are the
operators themselves (`rms_norm`, `linear`, `apply_rope`, `silu_mul`, `+`), which stay the
reference the kernels are tested against."""

from __future__ import annotations

import torch

from larql.inference.linear import linear
from larql.inference.norm import rms_norm
from larql.kernels import gemv_kernels
from larql.models.blocks import BlockRows


def normed_linear(
    h: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    blocks: BlockRows | None = None,
) -> torch.Tensor:
    """linear(rms_norm(h, norm, eps), weight, bias): h [S, K] → [S, N]."""
    if (kernels := gemv_kernels(h, weight)) is not None:
        return kernels.normed_gemv(h, norm, eps, weight, bias)
    return linear(rms_norm(h, norm, eps), weight, bias, blocks)


def normed_linear_rope(
    h: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotated_heads: int,
    head_dim: int,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """linear(rms_norm(h, norm, eps), weight, bias) with the first `rotated_heads` heads of
    head_dim rotated (`apply_rope`, cos and sin [1, rotary_dim]), in one launch where the
    kernels run it (h [1, K] → [1, N]); None elsewhere (the caller runs the product and RoPE).
    `cache` (keys, values, position): the K and V heads also stored there in that launch
    (`gemv.normed_gemv_rope`)."""
    kernels = gemv_kernels(h, weight)
    if kernels is None or not kernels.rope_fits(head_dim, cos.shape[-1], weight.shape[0]):
        return None
    return kernels.normed_gemv_rope(
        h, norm, eps, weight, bias, cos, sin, rotated_heads, head_dim, cache
    )


def residual_linear(
    h: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    blocks: BlockRows | None = None,
) -> torch.Tensor:
    """h + linear(x, weight, bias): h [S, N], x [S, K] → [S, N]."""
    if (kernels := gemv_kernels(x, weight)) is not None:
        return kernels.residual_gemv(h, x, weight, bias)
    return h + linear(x, weight, bias, blocks)


def gated_residual_linear(
    h: torch.Tensor,
    gate_up: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor | None:
    """h + linear(SiLU(gate) · up, weight), gate and up the two halves of gate_up [S, 2F], in
    one launch where the kernels run (h [S, N] → [S, N]); None elsewhere (the caller runs its
    own gated product, whatever its activation)."""
    if (kernels := gemv_kernels(gate_up, weight)) is None:
        return None
    return kernels.gated_residual_gemv(h, gate_up, weight)
