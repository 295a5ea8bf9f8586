"""Decode attention for B sessions in one step, each over its own static K/V cache.

`standard`'s fast path keeps a session's K/V per layer in [Hkv, C, D] buffers whose row i is
position i (`decode_attention` attends one query over one such cache). A batched step has B
sessions, each with buffers of its own, at its own position, allocated at its own capacity C_b.
A CUDA graph bakes in every address it launches with, so the kernels here do not take the
buffers: they take one `anchor` tensor and, per session, the element offsets of its key and value
buffers from the anchor, its position and its capacity — all device tensors filled before each
replay. One captured graph then serves any set of sessions (up to its batch size), and a session
whose cache grows changes an offset, not the graph.

Three launches per layer:
1. `_write_kernel`, one program per (sequence, K/V head): the new row's K and V into row
   `position` of the session's buffers.
2. `_partial_kernel`, one program per (sequence, K/V head, split of the keys): the
   flash-decoding split of `decode_attention`, G query heads padded to 16 rows for the matrix
   units; a split walks only the blocks at or below its session's position (and inside the
   window), so a short session costs little beside a long one.
3. `decode_attention`'s merge, one program per (sequence, K/V head): → [B, Hq·D].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from larql.kernels.decode_attention import (
    BATCH_MAX_SPLITS,
    combine_kernel,
    layout,
    partial_constants,
)
from larql.kernels.dependent_launch import options as dependent_options
from larql.kernels.dependent_launch import wait_for_previous
from larql.kernels.online_softmax import block_update, soft_capped, store_split


@triton.jit
def _write_kernel(
    k_ptr,  # [Hkv, B, D] the new rows' keys
    v_ptr,  # [Hkv, B, D]
    anchor_ptr,  # the element every offset counts from
    k_off_ptr,  # [B] int64: where session b's key buffer [Hkv, C_b, D] starts
    v_off_ptr,  # [B] int64
    pos_ptr,  # [B] int64
    cap_ptr,  # [B] int64: C_b
    B,
    D: tl.constexpr,
    DP: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `dependent_launch.options`
):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, DP)
    within = dims < D
    pos = tl.load(pos_ptr + row)
    at = (head * tl.load(cap_ptr + row) + pos) * D + dims
    source = (head * B + row) * D + dims
    key = tl.load(k_ptr + source, mask=within)
    value = tl.load(v_ptr + source, mask=within)
    tl.store(anchor_ptr + tl.load(k_off_ptr + row) + at, key, mask=within)
    tl.store(anchor_ptr + tl.load(v_off_ptr + row) + at, value, mask=within)


@triton.jit
def _partial_kernel(
    q_ptr,  # [Hq, B, D]
    anchor_ptr,
    k_off_ptr,  # [B] int64
    v_off_ptr,  # [B] int64
    pos_ptr,  # [B] int64
    cap_ptr,  # [B] int64
    m_ptr,  # [B·Hkv, NS, GP] float32
    l_ptr,
    acc_ptr,  # [B·Hkv, NS, GP, DP] float32
    B,
    scale,
    window,
    softcap,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    HKV: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr,
    NS: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 operands (not tf32); ignored for 16-bit ones
    PDL: tl.constexpr = False,  # launched with `dependent_launch.options`
):
    wait_for_previous(PDL)
    pair = tl.program_id(0)  # session · HKV + K/V head
    split = tl.program_id(1)
    row = pair // HKV
    head = pair % HKV
    rows = tl.arange(0, GP)
    dims = tl.arange(0, DP)
    dim_ok = dims < D
    q = tl.load(
        q_ptr + ((head * G + rows)[:, None] * B + row) * D + dims[None, :],
        mask=(rows < G)[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [GP, DP]
    pos = tl.load(pos_ptr + row)
    capacity = tl.load(cap_ptr + row)
    lowest = pos * 0
    if WINDOWED:
        lowest = tl.maximum(pos - window + 1, 0)
    k_base = anchor_ptr + tl.load(k_off_ptr + row) + head * capacity * D
    v_base = anchor_ptr + tl.load(v_off_ptr + row) + head * capacity * D
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    first = split * BLOCKS_PER_SPLIT * BLOCK  # the split's first key
    # the blocks of this split holding keys in [lowest, pos]
    begin = tl.minimum(tl.maximum(lowest - first, 0) // BLOCK, BLOCKS_PER_SPLIT)
    end = tl.minimum(tl.maximum(pos + 1 - first + BLOCK - 1, 0) // BLOCK, BLOCKS_PER_SPLIT)
    for b in tl.range(begin, end):
        keys = first + b * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        visible = (keys <= pos) & (keys >= lowest) & (keys < capacity)
        offsets = keys[:, None] * D + dims[None, :]  # [BLOCK, DP]
        load_mask = visible[:, None] & dim_ok[None, :]
        k = tl.load(k_base + offsets, mask=load_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GP, BLOCK]
        s = soft_capped(s, softcap, SOFTCAP)
        m_i, l_i, p, alpha = block_update(m_i, l_i, s, visible)
        v = tl.load(v_base + offsets, mask=load_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    store_split(m_ptr, l_ptr, acc_ptr, pair * NS + split, rows, dims, m_i, l_i, acc, DP)


def batched_decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    anchor: torch.Tensor,
    key_offsets: torch.Tensor,
    value_offsets: torch.Tensor,
    positions: torch.Tensor,
    capacities: torch.Tensor,
    max_capacity: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One decode row per session: q [Hq, B, D], its new k_new, v_new [Hkv, B, D] written into
    row positions[b] of session b's buffers, then the row attends over rows ≤ positions[b]
    (window > 0: the last `window`) of them. Session b's buffers are [Hkv, capacities[b], D]
    starting key_offsets[b] / value_offsets[b] elements after `anchor` (same dtype and device;
    the offsets, positions and capacities: [B] int64 device tensors). Every capacity must be
    ≤ `max_capacity`, which fixes the launch's shape. → [B, Hq·D] in q's dtype."""
    heads, batch, dim = q.shape
    kv_heads = k_new.shape[0]
    group, gp, dp, _, splits = layout(heads, kv_heads, dim, max_capacity, BATCH_MAX_SPLITS)
    k_new, v_new = k_new.contiguous(), v_new.contiguous()
    f32 = {"dtype": torch.float32, "device": q.device}
    m = torch.empty((batch * kv_heads, splits, gp), **f32)
    l_sum = torch.empty((batch * kv_heads, splits, gp), **f32)
    acc = torch.empty((batch * kv_heads, splits, gp, dp), **f32)
    out = torch.empty((batch, heads * dim), dtype=q.dtype, device=q.device)
    where = (anchor, key_offsets, value_offsets, positions, capacities)
    _write_kernel[(batch, kv_heads)](
        k_new, v_new, *where, batch, D=dim, DP=dp, **dependent_options(q.device)
    )
    _partial_kernel[(batch * kv_heads, splits)](
        q.contiguous(),
        *where,
        m,
        l_sum,
        acc,
        batch,
        scale,
        window,
        softcap,
        HKV=kv_heads,
        **partial_constants(
            heads, kv_heads, dim, max_capacity, window, softcap, q.dtype, BATCH_MAX_SPLITS
        ),
        **dependent_options(q.device),
    )
    # one program per (sequence, K/V head) = one "head" of a [B·Hkv] decode: out [B, Hq·D] is
    # [B·Hq, D] with query head b·Hq + h·G + r — the one-session merge, unchanged
    combine_kernel[(batch * kv_heads,)](
        m,
        l_sum,
        acc,
        out,
        G=group,
        GP=gp,
        GR=1 << (group - 1).bit_length(),
        D=dim,
        DP=dp,
        NS=splits,
        **dependent_options(q.device),
    )
    return out
