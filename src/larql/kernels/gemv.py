"""A decode step's one-row products (GEMVs) on CUDA, each with the small launch before or after
it folded in: the RMS norm before the QKV and gate/up products (and the LM head), RoPE after the
QKV product, SiLU(gate) · up before the down product, the residual add after the output and down
products.

In a graph-replayed decode step on an H200 each of those small launches costs ~1.5–2 µs however
little it computes, and a layer had eight of them beside its four products. Folded in, a layer
launches four products and its attention: a static cache's K/V row is written by the QKV
product's own launch (`normed_gemv_rope`'s `cache`). The product itself is a plain GEMV:
each program reduces `BN` whole output rows, `BK` columns at a time, in float32, and the weight is
read once. Each program reads its first tile of the weight (a row of up to `BK`: all of it)
before it waits for the previous launch (`dependent_launch`): no launch writes a weight, and the
read then overlaps the end of the launch before.

The roundings are torch's, in the same order, so each result equals the unfused operators' up to
the order of the product's sum: the normalised row rounded to the dtype before × weight (as
`larql.inference.norm.rms_norm`), SiLU(gate) rounded before × up, the product rounded (after its
bias) before the residual is added, and RoPE's x·cos rounded before the multiply-add (as
`larql.inference.rope.apply_rope`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from larql.kernels.dependent_launch import options as dependent_options
from larql.kernels.dependent_launch import wait_for_previous

PLAIN, NORMED, GATED = 0, 1, 2  # what the kernel does to its input row before the product
_WIDEST_TILE = 2048  # columns of the weight a program reads at once (`_shape`)


@triton.jit
def _input_chunk(
    x_ptr,
    norm_ptr,
    cols,
    present,
    scale,
    K: tl.constexpr,
    PROLOGUE: tl.constexpr,
):
    """Columns `cols` of the product's input row, in float32 (rounded as torch rounds them)."""
    if PROLOGUE == 2:  # x holds gate then up: [2·K]
        gate = tl.load(x_ptr + cols, mask=present, other=0.0)
        g = gate.to(tl.float32)
        activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded, as torch's SiLU
        up = tl.load(x_ptr + K + cols, mask=present, other=0.0).to(tl.float32)
        return (activated.to(tl.float32) * up).to(gate.dtype).to(tl.float32)
    x = tl.load(x_ptr + cols, mask=present, other=0.0)
    if PROLOGUE == 1:
        normalised = (x.to(tl.float32) * scale).to(x.dtype)  # rounded, as torch's norm
        weight = tl.load(norm_ptr + cols, mask=present, other=0.0).to(tl.float32)
        return (normalised.to(tl.float32) * weight).to(x.dtype).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _norm_scale(x_ptr, eps, K: tl.constexpr, BK: tl.constexpr, PROLOGUE: tl.constexpr):
    """1 / RMS of the input row for NORMED (statistics in float32), else 1."""
    scale = 1.0
    if PROLOGUE == 1:
        squares = tl.zeros([BK], dtype=tl.float32)
        for start in tl.range(0, K, BK):
            cols = start + tl.arange(0, BK)
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            squares += x * x
        scale = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    return scale


@triton.jit
def _gemv_kernel(
    w_ptr,  # [N, K] contiguous
    x_ptr,  # [K] the input row; [2·K] gate then up for GATED
    norm_ptr,  # [K] the norm's weight (NORMED)
    bias_ptr,  # [N] (HAS_BIAS)
    residual_ptr,  # [N] (HAS_RESIDUAL)
    y_ptr,  # [N]
    n,  # N
    eps,
    K: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    WIDE: tl.constexpr,  # N · K ≥ 2³¹: the weight's offsets in 64 bits
    PDL: tl.constexpr = False,  # launched with `dependent_launch.options`
):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN]
    inside = rows < n
    starts = rows.to(tl.int64) * K if WIDE else rows * K  # [BN] each row's first weight
    # The program's first [BN, BK] tile of the weight (a row of up to BK is all of it). No
    # launch writes a weight, so it is read before waiting for the previous launch: the read
    # overlaps that launch's end.
    cols = tl.arange(0, BK)  # [BK]
    present = cols < K
    mask = inside[:, None] & present[None, :]
    first = tl.load(w_ptr + starts[:, None] + cols[None, :], mask=mask, other=0.0)  # [BN, BK]
    wait_for_previous(PDL)
    scale = _norm_scale(x_ptr, eps, K, BK, PROLOGUE)
    x = _input_chunk(x_ptr, norm_ptr, cols, present, scale, K, PROLOGUE)  # [BK]
    acc = first.to(tl.float32) * x[None, :]  # [BN, BK]
    for start in tl.range(BK, K, BK):  # the rest of a row wider than a tile
        cols = start + tl.arange(0, BK)  # [BK]
        present = cols < K
        x = _input_chunk(x_ptr, norm_ptr, cols, present, scale, K, PROLOGUE)  # [BK]
        mask = inside[:, None] & present[None, :]
        w = tl.load(w_ptr + starts[:, None] + cols[None, :], mask=mask, other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)  # [BN]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=inside, other=0.0).to(tl.float32)
    y = y.to(y_ptr.dtype.element_ty)  # rounded, as torch's product
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + rows, mask=inside, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + residual).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows, y, mask=inside)


@triton.jit
def _normed_gemv_rope_kernel(
    w_ptr,  # [N, K] contiguous, N a whole number of heads of D
    x_ptr,  # [K] the input row
    norm_ptr,  # [K] the norm's weight
    bias_ptr,  # [N] (HAS_BIAS)
    cos_ptr,  # [D] the row's cos, [cos θ, cos θ]
    sin_ptr,  # [D] the row's signed sin, [−sin θ, sin θ]
    y_ptr,  # [N]
    keys_ptr,  # [Hkv, C, D] contiguous (STORE_KV)
    values_ptr,  # [Hkv, C, D] contiguous (STORE_KV)
    pos_ptr,  # [1] int64: the cache row the K/V heads go to (STORE_KV)
    capacity,  # C
    rotated_heads,  # the first heads of the output are rotated (q and k), the rest not (v)
    kv_heads,  # the last rotated heads are K's, as many after them V's (STORE_KV)
    eps,
    K: tl.constexpr,
    D: tl.constexpr,  # head dim, all of it rotated
    PAIRS: tl.constexpr,  # rotation pairs a program computes (2·PAIRS output rows)
    BK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WIDE: tl.constexpr,
    STORE_KV: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """`_gemv_kernel` with the norm before and RoPE after: each program's rows are PAIRS
    consecutive dims of a head's first half and their partners in its second half, so the
    rotation of each pair (x₁·cos − x₂·sin, x₂·cos + x₁·sin) needs no other program's result.
    With STORE_KV a program of a K or V head also writes its rows into the cache's row at the
    position (the K/V row store folded in)."""
    half: tl.constexpr = D // 2
    pid = tl.program_id(0)
    head = pid // (half // PAIRS)
    first = head * D + (pid % (half // PAIRS)) * PAIRS  # the program's first row
    dims = (first - head * D) + tl.arange(0, PAIRS)  # [PAIRS] dims of the first half
    rows = first + tl.arange(0, PAIRS)[:, None] + half * tl.arange(0, 2)[None, :]  # [PAIRS, 2]
    starts = rows.to(tl.int64) * K if WIDE else rows * K
    cols = tl.arange(0, BK)  # [BK]
    present = cols < K
    # the first tile read before the wait, as in `_gemv_kernel`
    first = tl.load(
        w_ptr + starts[:, :, None] + cols[None, None, :], mask=present[None, None, :], other=0.0
    )  # [PAIRS, 2, BK]
    wait_for_previous(PDL)
    scale = _norm_scale(x_ptr, eps, K, BK, 1)
    x = _input_chunk(x_ptr, norm_ptr, cols, present, scale, K, 1)  # [BK]
    acc = first.to(tl.float32) * x[None, None, :]  # [PAIRS, 2, BK]
    for start in tl.range(BK, K, BK):
        cols = start + tl.arange(0, BK)
        present = cols < K
        x = _input_chunk(x_ptr, norm_ptr, cols, present, scale, K, 1)
        offsets = starts[:, :, None] + cols[None, None, :]
        w = tl.load(w_ptr + offsets, mask=present[None, None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, None, :]
    y = tl.sum(acc, axis=2)  # [PAIRS, 2]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    y = y.to(dtype)  # rounded, as torch's product
    low, high = tl.split(y)  # [PAIRS] each: a dim of the first half, its partner
    cos_low = tl.load(cos_ptr + dims).to(tl.float32)
    cos_high = tl.load(cos_ptr + half + dims).to(tl.float32)
    sin_low = tl.load(sin_ptr + dims).to(tl.float32)
    sin_high = tl.load(sin_ptr + half + dims).to(tl.float32)
    # x·cos rounded before the multiply-add, as `apply_rope` and the RoPE launch compute it
    low_cos = (low.to(tl.float32) * cos_low).to(dtype).to(tl.float32)
    high_cos = (high.to(tl.float32) * cos_high).to(dtype).to(tl.float32)
    rotated = tl.join(
        (low_cos + high.to(tl.float32) * sin_low).to(dtype),
        (high_cos + low.to(tl.float32) * sin_high).to(dtype),
    )  # [PAIRS, 2]
    out = tl.where(head < rotated_heads, rotated, y)
    tl.store(y_ptr + rows, out)
    if STORE_KV:
        kv_head = head - (rotated_heads - kv_heads)  # K heads 0 … Hkv − 1, then V heads
        if kv_head >= 0:
            row = ((kv_head % kv_heads) * capacity + tl.load(pos_ptr)) * D + (rows - head * D)
            if kv_head < kv_heads:
                tl.store(keys_ptr + row, out)
            else:
                tl.store(values_ptr + row, out)


def _shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """(BN, BK, warps) for a [N, K] product: four rows a program, up to 2,048 columns a tile
    (a row of up to 2,048 is one tile, read before the wait), eight warps. Timed on an H200
    against the best of 1–8 rows, 1,024–8,192 columns and 4 or 8 warps for each of the 1B
    shape's products (docs/PERFORMANCE.md), it is within 7% of each and 2% of their sum."""
    return 4, min(_WIDEST_TILE, triton.next_power_of_2(in_features)), 8


def _launch(
    weight: torch.Tensor,
    x: torch.Tensor,
    prologue: int,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    out_features, in_features = weight.shape
    out = torch.empty((1, out_features), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = _shape(out_features, in_features)
    grid = (triton.cdiv(out_features, block_n),)
    _gemv_kernel[grid](
        weight,
        x,
        norm if norm is not None else x,
        bias if bias is not None else out,
        residual if residual is not None else out,
        out,
        out_features,
        eps,
        K=in_features,
        BN=block_n,
        BK=block_k,
        PROLOGUE=prologue,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        WIDE=weight.numel() >= 2**31,
        num_warps=warps,
        **dependent_options(x.device),
    )
    return out


def _row(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def normed_gemv(
    h: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """rms_norm(h) · weightᵀ (+ bias) in one launch. h: [1, K]; norm: [K]; weight: [N, K]
    contiguous → [1, N]."""
    return _launch(weight, _row(h), NORMED, norm=norm, eps=eps, bias=bias)


def residual_gemv(
    h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """h + x · weightᵀ (+ bias) in one launch. h: [1, N]; x: [1, K]; weight: [N, K] → [1, N]."""
    return _launch(weight, _row(x), PLAIN, bias=bias, residual=_row(h))


def gated_residual_gemv(
    h: torch.Tensor, gate_up: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """h + (SiLU(gate) · up) · weightᵀ in one launch, gate and up the halves of gate_up.
    h: [1, N]; gate_up: [1, 2·K]; weight: [N, K] → [1, N]."""
    return _launch(weight, _row(gate_up), GATED, residual=_row(h))


def rope_fits(head_dim: int, rotary_dim: int, out_features: int) -> bool:
    """Whether `normed_gemv_rope` computes a product of `out_features` rows in heads of
    `head_dim`, rotated over `rotary_dim` dims: the whole head rotated, and a program's rows
    (`_shape`'s BN: half of them in each half of a head) dividing it."""
    rows = _shape(out_features, 1)[0]
    return rotary_dim == head_dim and head_dim % rows == 0 and out_features % head_dim == 0


def normed_gemv_rope(
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
) -> torch.Tensor:
    """rms_norm(h) · weightᵀ (+ bias), the first `rotated_heads` heads of the result rotated
    (as `apply_rope` rotates each head's halves), in one launch. h: [1, K]; norm: [K]; weight:
    [N, K] contiguous, N a multiple of head_dim (`rope_fits`); cos, sin: [1, head_dim] of the
    `RopeTable` → [1, N]. `cache` (keys, values, position): the result's last heads — K's, the
    last rotated ones, then as many of V's — also go into keys, values [Hkv, C, D] (contiguous,
    of h's dtype) at row `position` ([1] int64 on the device), in the same launch."""
    out_features, in_features = weight.shape
    out = torch.empty((1, out_features), dtype=h.dtype, device=h.device)
    block_n, block_k, warps = _shape(out_features, in_features)
    keys, values, position = cache if cache is not None else (out, out, out)
    kv_heads, capacity = (keys.shape[0], keys.shape[1]) if cache is not None else (0, 0)
    _normed_gemv_rope_kernel[(out_features // block_n,)](
        weight,
        _row(h),
        norm,
        bias if bias is not None else out,
        _row(cos),
        _row(sin),
        out,
        keys,
        values,
        position,
        capacity,
        rotated_heads,
        kv_heads,
        eps,
        K=in_features,
        D=head_dim,
        PAIRS=block_n // 2,
        BK=block_k,
        HAS_BIAS=bias is not None,
        WIDE=weight.numel() >= 2**31,
        STORE_KV=cache is not None,
        num_warps=warps,
        **dependent_options(h.device),
    )
    return out
