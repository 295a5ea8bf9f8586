"""One-launch forms of four row-wise steps of a layer on CUDA: RoPE over q and k, the gated
MLP's SiLU(gate) · up, a 16-bit RMS norm with its weight, and a decode step's K and V rows
written into a static cache.

In a decode step each launch costs ~1.5–2.5 µs however little it computes, and torch spends
three on RoPE (the halves swapped, x·cos, the multiply-add), two on SiLU · up, two on a 16-bit
norm (the normalised row, then × weight) and two on the K/V rows (an `index_copy_` each); these
do each in one. The roundings are torch's, in
the same order: x·cos is rounded to the tensor's dtype before the multiply-add (as `apply_rope`
computes it), SiLU(gate) before the product, the normalised row before the weight — so the
results are torch's up to how the device contracts a multiply and an add and orders a sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from larql.kernels.dependent_launch import options as dependent_options
from larql.kernels.dependent_launch import wait_for_previous


@triton.jit
def _rope_kernel(
    x_ptr,  # [H, S, D], the last dim contiguous
    cos_ptr,  # [S, R] contiguous: [cos θ, cos θ]
    sin_ptr,  # [S, R] contiguous: [−sin θ, sin θ]
    out_ptr,  # [H, S, D] contiguous
    rows,  # S
    stride_h,
    stride_s,
    D: tl.constexpr,
    R: tl.constexpr,
    DP: tl.constexpr,  # D rounded up to a power of two
    PDL: tl.constexpr = False,  # launched with `dependent_launch.options`
):
    wait_for_previous(PDL)
    pid = tl.program_id(0)
    head = pid // rows
    row = pid % rows
    dims = tl.arange(0, DP)
    present = dims < D
    rotated = dims < R
    half = R // 2
    partner = tl.where(dims < half, dims + half, dims - half)
    base = x_ptr + head * stride_h + row * stride_s
    x = tl.load(base + dims, mask=present, other=0.0)
    x_partner = tl.load(base + partner, mask=rotated, other=0.0)
    cos = tl.load(cos_ptr + row * R + dims, mask=rotated, other=1.0)
    sin = tl.load(sin_ptr + row * R + dims, mask=rotated, other=0.0)
    scaled = (x.to(tl.float32) * cos.to(tl.float32)).to(x.dtype)  # rounded, as torch's x·cos
    out = scaled.to(tl.float32) + x_partner.to(tl.float32) * sin.to(tl.float32)
    out = tl.where(rotated, out, x.to(tl.float32))
    tl.store(out_ptr + pid * D + dims, out.to(x.dtype), mask=present)


# A row is a few dozen values: one warp holds a head of up to 64 (on an H200 the launch 1.32 →
# 1.16 µs against Triton's default of 4 warps)
_ONE_WARP_DIM = 64


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in one launch. x: [H, S, D]; cos, sin: [S, R] (R ≤ D, even) → [H, S, D]."""
    heads, rows, dim = x.shape
    rotary_dim = cos.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((heads, rows, dim), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    padded = triton.next_power_of_2(dim)
    _rope_kernel[(heads * rows,)](
        x,
        cos.contiguous(),
        sin.contiguous(),
        out,
        rows,
        x.stride(0),
        x.stride(1),
        D=dim,
        R=rotary_dim,
        DP=padded,
        num_warps=1 if padded <= _ONE_WARP_DIM else 4,
        **dependent_options(x.device),
    )
    return out


_SILU_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(
    gate_ptr,  # [S, F], the last dim contiguous
    up_ptr,  # [S, F], the last dim contiguous
    out_ptr,  # [S, F] contiguous
    width,  # F
    stride_gate,
    stride_up,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `dependent_launch.options`
):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    present = cols < width
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=present, other=0.0)
    up = tl.load(up_ptr + row * stride_up + cols, mask=present, other=0.0)
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded, as torch's SiLU
    out = activated.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * width + cols, out.to(gate.dtype), mask=present)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up in one launch. gate, up: [S, F] (rows may be strided, e.g. the two
    halves of one [S, 2F] product) → [S, F]."""
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    if up.stride(-1) != 1:
        up = up.contiguous()
    rows, width = gate.shape
    out = torch.empty((rows, width), dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    grid = (rows, triton.cdiv(width, _SILU_BLOCK))
    _silu_mul_kernel[grid](
        gate,
        up,
        out,
        width,
        gate.stride(0),
        up.stride(0),
        BLOCK=_SILU_BLOCK,
        **dependent_options(gate.device),
    )
    return out


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [N, W], the last dim contiguous
    weight_ptr,  # [W]
    out_ptr,  # [N, W] contiguous
    width,  # W
    stride_row,
    eps,
    BLOCK: tl.constexpr,  # W rounded up to a power of two
    PDL: tl.constexpr = False,  # launched with `dependent_launch.options`
):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    present = cols < width
    x = tl.load(x_ptr + row * stride_row + cols, mask=present, other=0.0)
    xf = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(xf * xf, axis=0) / width + eps)
    normalised = (xf * scale).to(x.dtype)  # rounded, as torch's norm without a weight
    weight = tl.load(weight_ptr + cols, mask=present, other=0.0)
    out = normalised.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * width + cols, out.to(x.dtype), mask=present)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dim, then × weight, in one launch: x [..., W] → [..., W]."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)  # a view where it can be
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        weight,
        out,
        width,
        rows.stride(0),
        eps,
        BLOCK=triton.next_power_of_2(width),
        **dependent_options(x.device),
    )
    return out


@triton.jit
def _store_row_kernel(
    k_ptr,  # [Hkv, 1, D], the last dim contiguous
    v_ptr,  # [Hkv, 1, D], the last dim contiguous
    keys_ptr,  # [Hkv, C, D] contiguous
    values_ptr,  # [Hkv, C, D] contiguous
    pos_ptr,  # [1] int64
    capacity,
    stride_k,
    stride_v,
    D: tl.constexpr,
    DP: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `dependent_launch.options`
):
    wait_for_previous(PDL)
    head = tl.program_id(0)
    dims = tl.arange(0, DP)
    present = dims < D
    row = (head * capacity + tl.load(pos_ptr)) * D
    k = tl.load(k_ptr + head * stride_k + dims, mask=present)
    v = tl.load(v_ptr + head * stride_v + dims, mask=present)
    tl.store(keys_ptr + row + dims, k, mask=present)
    tl.store(values_ptr + row + dims, v, mask=present)


def store_row(
    keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
) -> None:
    """keys[:, pos] = k and values[:, pos] = v in one launch, the position read on the device.
    keys, values: [Hkv, C, D] contiguous; k, v: [Hkv, 1, D]; pos: [1] int64."""
    heads, capacity, dim = keys.shape
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _store_row_kernel[(heads,)](
        k,
        v,
        keys,
        values,
        pos,
        capacity,
        k.stride(0),
        v.stride(0),
        D=dim,
        DP=triton.next_power_of_2(dim),
        **dependent_options(keys.device),
    )
