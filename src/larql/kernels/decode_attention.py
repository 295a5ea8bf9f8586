"""Decode attention over a fixed-capacity K/V cache: one query per head, split over the keys.

The static-cache engine keeps each layer's K/V in [Hkv, C, D] buffers whose row i is position i
and reads the current position from a device tensor, so the step can be captured in a CUDA
graph. torch's fused attention over that buffer takes a mask over all C rows and costs ~17 µs
per layer on an H200 for one query (it is built for many). This is the flash-decoding scheme
instead, in one launch:

1. `_partial_kernel`, one program per (K/V head, split of the keys): the G query heads that
   share the K/V head, padded to 16 rows for the matrix units, against BLOCK_N keys at a time;
   keys past the position (or before the window) are masked off, so their loads never happen.
   Each split leaves its running max m, sum l and unnormalised output acc (float32).
2. The last of a head's splits to finish (counted on a per-head counter, which it sets back to
   0) merges them: rescales the splits to the global max and divides, → [Hq, D] in the query's
   dtype. A second launch for the merge (`combine_kernel`, which the batched kernel keeps)
   cost a launch a layer: the decode step of a small model is a chain of launches of a few
   microseconds each.

Soft-capped scores (Gemma 2: cap·tanh(s / cap)) are supported; tanh(x) = 2σ(2x) − 1.
`decode_attention` is the function to call; `decode_attention_op` is the same thing registered
as a torch custom op, opaque to torch.compile, so a compiled step calls it unchanged.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from larql.kernels.dependent_launch import options as dependent_options
from larql.kernels.dependent_launch import wait_for_previous
from larql.kernels.online_softmax import (
    SPLITS_AT_ONCE,
    block_update,
    merge_splits,
    soft_capped,
    splits_max,
    store_split,
)

BLOCK_N = 64  # keys per block
# A split's blocks are unrolled up to this many (a cache of up to 32,768 rows at 128 splits);
# past it they are a loop: unrolled, 16 blocks (131,072 rows) took 22 s to compile for sm_90
UNROLLED_BLOCKS = tl.constexpr(4)
# the combine loops over splits; past this a split takes several blocks. 128, not 32: on an H200
# one decode step of the 1B shape at depth 32,000 went from 727.6 to 811.8 tok/s (16,384: 750.7
# → 883.6), the shorter depths unchanged (docs/PERFORMANCE.md)
MAX_SPLITS = 128
# a batched step's programs multiply by its sessions: it keeps the 32 it was measured with
BATCH_MAX_SPLITS = 32
_MIN_DOT = 16  # tl.dot needs every dimension ≥ 16
# the partial launch's merge takes this many splits a step: sixteen (the combine launch's) held
# [16, rows, D] tiles beside the split's own registers and spilled at 128 splits (sm_90)
MERGE_AT_ONCE = tl.constexpr(16)


@triton.jit
def _partial_kernel(
    q_ptr,  # [Hq, D]
    k_ptr,  # [Hkv, C, D]
    v_ptr,  # [Hkv, C, D]
    pos_ptr,  # [1] int64: the query's position
    m_ptr,  # [Hkv, NS, GP] float32
    l_ptr,  # [Hkv, NS, GP] float32
    acc_ptr,  # [Hkv, NS, GP, DP] float32
    out_ptr,  # [Hq, D] the query's dtype
    done_ptr,  # [≥ Hkv] int32: splits of each head done in this launch, 0 between launches
    scale,
    window,
    softcap,
    capacity,
    G: tl.constexpr,
    GP: tl.constexpr,
    GR: tl.constexpr,  # the rows merged: G rounded up to a power of two
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr,
    NS: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 operands (not tf32); ignored for 16-bit ones
    MERGE: tl.constexpr = True,  # the last split merges (False: `combine_kernel` does, after)
    PDL: tl.constexpr = False,  # launched with `dependent_launch.options`
):
    wait_for_previous(PDL)
    head = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, GP)
    dims = tl.arange(0, DP)
    row_ok = rows < G
    dim_ok = dims < D
    q = tl.load(
        q_ptr + (head * G + rows)[:, None] * D + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [GP, DP]
    pos = tl.load(pos_ptr)
    lowest = 0
    if WINDOWED:
        lowest = pos - window + 1
    base = head * capacity * D
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    first = split * BLOCKS_PER_SPLIT
    if BLOCKS_PER_SPLIT <= UNROLLED_BLOCKS:
        for b in tl.static_range(BLOCKS_PER_SPLIT):
            m_i, l_i, acc = _attend_block(
                k_ptr, v_ptr, q, m_i, l_i, acc, first + b, base, dims, dim_ok, pos, lowest,
                capacity, scale, softcap, D, BLOCK, SOFTCAP, PRECISION,
            )  # fmt: skip
    else:  # a deep cache: a loop, not unrolled (the compile time grows with the unrolling)
        for b in tl.range(0, BLOCKS_PER_SPLIT):
            m_i, l_i, acc = _attend_block(
                k_ptr, v_ptr, q, m_i, l_i, acc, first + b, base, dims, dim_ok, pos, lowest,
                capacity, scale, softcap, D, BLOCK, SOFTCAP, PRECISION,
            )  # fmt: skip
    if NS == 1 and MERGE:  # the one split's state is the head's: its output, no state stored
        offsets = (head * G + rows)[:, None] * D + dims[None, :]
        mask = row_ok[:, None] & dim_ok[None, :]  # (a split sees the query's own row: l > 0)
        tl.store(out_ptr + offsets, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        store_split(m_ptr, l_ptr, acc_ptr, head * NS + split, rows, dims, m_i, l_i, acc, DP)
        if MERGE:
            # every thread's stores precede the count, which releases them to the program that
            # counts last and acquires them (read past its L1); it sets the count back
            tl.debug_barrier()
            done = tl.atomic_add(done_ptr + head, 1, sem="acq_rel", scope="gpu")
            if done == NS - 1:
                _merged(
                    m_ptr, l_ptr, acc_ptr, out_ptr, head, G, GP, GR, D, DP, NS, ".cg",
                    MERGE_AT_ONCE,
                )  # fmt: skip
                tl.atomic_xchg(done_ptr + head, 0, sem="relaxed", scope="gpu")


@triton.jit
def _attend_block(
    k_ptr,
    v_ptr,
    q,
    m_i,
    l_i,
    acc,
    block,
    base,
    dims,
    dim_ok,
    pos,
    lowest,
    capacity,
    scale,
    softcap,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Keys block · BLOCK.. of one K/V head (from `base`) into the running state m_i [GP],
    l_i [GP], acc [GP, DP]: those at or before `pos`, from `lowest`, within `capacity`."""
    keys = block * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    visible = (keys <= pos) & (keys >= lowest) & (keys < capacity)
    offsets = base + keys[:, None] * D + dims[None, :]  # [BLOCK, DP]
    load_mask = visible[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + offsets, mask=load_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GP, BLOCK]
    s = soft_capped(s, softcap, SOFTCAP)
    m_i, l_i, p, alpha = block_update(m_i, l_i, s, visible)
    v = tl.load(v_ptr + offsets, mask=load_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # [GP, DP]
    return m_i, l_i, acc


@triton.jit
def _merged(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    head,
    G: tl.constexpr,
    GP: tl.constexpr,
    GR: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    NS: tl.constexpr,
    CACHE: tl.constexpr,
    AT_ONCE: tl.constexpr,
):
    """Head `head`'s NS split states ([Hkv, NS, GP(, DP)]) merged → its G rows of out_ptr
    [Hq, D]. CACHE: the state loads' cache modifier; AT_ONCE: the splits a step merges."""
    rows = tl.arange(0, GR)
    dims = tl.arange(0, DP)
    lowest = tl.full([GR], float("-inf"), tl.float32)
    top = splits_max(m_ptr, head, rows, lowest, NS, GP, CACHE, AT_ONCE)
    zeros = (tl.zeros([GR], tl.float32), tl.zeros([GR, DP], tl.float32))
    total, out = merge_splits(
        m_ptr, l_ptr, acc_ptr, head, rows, dims, top, *zeros, NS, DP, GP, CACHE, AT_ONCE
    )
    out = out / total[:, None]
    mask = (rows < G)[:, None] & (dims < D)[None, :]
    offsets = (head * G + rows)[:, None] * D + dims[None, :]
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def combine_kernel(
    m_ptr,  # [Hkv, NS, GP] float32
    l_ptr,
    acc_ptr,  # [Hkv, NS, GP, DP] float32
    out_ptr,  # [Hq, D]
    G: tl.constexpr,
    GP: tl.constexpr,
    GR: tl.constexpr,  # the rows merged: G rounded up to a power of two (no dot pads them)
    D: tl.constexpr,
    DP: tl.constexpr,
    NS: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `dependent_launch.options`
):
    """The splits' states of a launch before this one merged, one program per K/V head (of
    each sequence, for the batched kernel)."""
    wait_for_previous(PDL)
    head = tl.program_id(0)
    _merged(m_ptr, l_ptr, acc_ptr, out_ptr, head, G, GP, GR, D, DP, NS, "", SPLITS_AT_ONCE)


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.cache
def layout(
    heads: int, kv_heads: int, dim: int, capacity: int, max_splits: int = MAX_SPLITS
) -> tuple[int, ...]:
    """(G, GP, DP, blocks_per_split, splits) for these shapes."""
    group = heads // kv_heads
    blocks = -(-capacity // BLOCK_N)
    per_split = -(-blocks // max_splits)
    splits = -(-blocks // per_split)
    return (
        group,
        max(_MIN_DOT, _next_power_of_two(group)),
        max(_MIN_DOT, _next_power_of_two(dim)),
        per_split,
        splits,
    )


def partial_constants(
    heads: int,
    kv_heads: int,
    dim: int,
    capacity: int,
    window: int,
    softcap: float,
    dtype: torch.dtype,
    max_splits: int = MAX_SPLITS,
) -> dict[str, int | bool | str]:
    """The split-key partial kernels' compile-time constants (this module's and the batched
    one's) for these shapes."""
    group, gp, dp, per_split, splits = layout(heads, kv_heads, dim, capacity, max_splits)
    return {
        "G": group,
        "GP": gp,
        "D": dim,
        "DP": dp,
        "BLOCK": BLOCK_N,
        "BLOCKS_PER_SPLIT": per_split,
        "NS": splits,
        "WINDOWED": window > 0,
        "SOFTCAP": softcap > 0.0,
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


# Per device, the heads' split counters of the single-query launch: all 0 between launches
# (each launch's last split of a head sets its back), so every launch on the device shares them
# — the launches of a stream run one after another (a launch waits for the one before it, even
# with programmatic dependent launch, before its programs touch anything).
_MAX_KV_HEADS = 1024


@functools.cache
def _split_counters(device: torch.device) -> torch.Tensor:
    # made by a first launch outside any CUDA graph capture (a captured step runs once first):
    # zeros made inside one would be zeroed only when the graph replays
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    assert not capturing, "decode attention's first launch on a device runs before a capture"
    return torch.zeros(_MAX_KV_HEADS, dtype=torch.int32, device=device)


def _launch(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
    one_launch: bool = True,
) -> torch.Tensor:
    heads, _, dim = q.shape
    kv_heads, capacity, _ = keys.shape
    assert kv_heads <= _MAX_KV_HEADS, f"at most {_MAX_KV_HEADS} K/V heads"
    group, gp, dp, _, splits = layout(heads, kv_heads, dim, capacity)
    f32 = {"dtype": torch.float32, "device": q.device}
    m = torch.empty((kv_heads, splits, gp), **f32)
    l_sum = torch.empty((kv_heads, splits, gp), **f32)
    acc = torch.empty((kv_heads, splits, gp, dp), **f32)
    out = torch.empty((heads, dim), dtype=q.dtype, device=q.device)
    _partial_kernel[(kv_heads, splits)](
        q,
        keys,
        values,
        position,
        m,
        l_sum,
        acc,
        out,
        _split_counters(q.device),
        scale,
        window,
        softcap,
        capacity,
        GR=_next_power_of_two(group),
        MERGE=one_launch,
        **partial_constants(heads, kv_heads, dim, capacity, window, softcap, q.dtype),
        **dependent_options(q.device),
    )
    if not one_launch:
        constants = {"G": group, "GP": gp, "GR": _next_power_of_two(group), "D": dim, "DP": dp}
        combine_kernel[(kv_heads,)](
            m, l_sum, acc, out, **constants, NS=splits, **dependent_options(q.device)
        )
    return out.view(heads, 1, dim)


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    one_launch: bool = True,
) -> torch.Tensor:
    """One query per head q: [Hq, 1, D] (contiguous) at `position` ([1] int64 on the device)
    over keys/values [Hkv, C, D] whose row i is position i; a key is seen iff i ≤ position and
    (window > 0) position − i < window. softcap > 0: scores cap·tanh(s / cap). → [Hq, 1, D].
    `one_launch=False` merges the splits in a second launch instead (to compare the two)."""
    return _launch(q.contiguous(), keys, values, position, scale, window, softcap, one_launch)


@torch.library.custom_op("larql::decode_attention", mutates_args=())
def decode_attention_op(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """`decode_attention` as an op torch.compile keeps opaque: a compiled step calls the plain
    launcher, as the uncompiled step does. (Registered as a `triton_op`, whose kernels Inductor
    launches itself, the same kernel took 77.4 µs per layer at depth 32,000 on an H200 against
    34.8 launched plainly.)"""
    return decode_attention(q, keys, values, position, scale, window, softcap)


@decode_attention_op.register_fake
def _(q, keys, values, position, scale, window, softcap):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
