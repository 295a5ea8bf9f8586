"""The pieces of split-key (flash-decoding) attention both decode kernels share, as Triton
device functions: soft-capping, one block's online-softmax update, storing a split's partial
state and merging the splits.

A split's state is, per query row, the running max m, the sum l of exp(s − m) and the
unnormalised output acc = Σ exp(s − m)·v, all float32; an empty split has m = −inf, l = 0,
acc = 0 and weighs nothing in the merge.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_capped(s, cap, SOFTCAP: tl.constexpr):
    """cap·tanh(s / cap) when SOFTCAP (tanh(x) = 2σ(2x) − 1), else s."""
    if SOFTCAP:
        s = cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)
    return s


@triton.jit
def block_update(m_i, l_i, s, visible):
    """Scores s [GP, B] of one block (`visible` [B]) into the running max and sum → (m, l,
    p [GP, B] the block's weights, alpha [GP] the factor the previous acc is rescaled by)."""
    s = tl.where(visible[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [GP]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)  # 0 while m_i is still -inf
    p = tl.exp(s - m_safe[:, None])  # 0 where not visible
    return m_new, l_i * alpha + tl.sum(p, axis=1), p, alpha


@triton.jit
def store_split(m_ptr, l_ptr, acc_ptr, slot, rows, dims, m_i, l_i, acc, DP: tl.constexpr):
    """A split's state at `slot` (= head · NS + split) of [Hkv, NS, GP(, DP)] buffers."""
    stat = slot * rows.shape[0] + rows
    tl.store(m_ptr + stat, m_i)
    tl.store(l_ptr + stat, l_i)
    tl.store(acc_ptr + stat[:, None] * DP + dims[None, :], acc)


# Splits merged per unrolled step: [SPLITS_AT_ONCE, R(, DP)] tiles, summed elementwise across
# steps and reduced over the splits once at the end (a reduction per step crosses warps each
# time). Unrolling one step a split made the merge of 128 splits (`standard` at depth 32,000)
# take ~190 s in Triton's TTGIR passes on its first launch; eight steps of sixteen take seconds.
SPLITS_AT_ONCE: tl.constexpr = tl.constexpr(16)
# the merge's loads' default cache modifier (the default's: a plain "" fails on Triton 3.6)
CACHED: tl.constexpr = tl.constexpr("")


@triton.jit
def _weighted_tile(
    m_ptr,
    l_ptr,
    acc_ptr,
    head,
    rows,
    dims,
    top,
    first,
    NS: tl.constexpr,
    DP: tl.constexpr,
    GP: tl.constexpr,
    CACHE: tl.constexpr,
    C: tl.constexpr,
):
    """Splits first.. first + C of head `head`, each rescaled to `top` → (their l [C, R], their
    acc [C, R, DP]); splits past NS weigh nothing. CACHE: the loads' cache modifier."""
    splits = first + tl.arange(0, C)  # [C]
    real = (splits < NS)[:, None]  # [C, 1]
    stat = (head * NS + splits)[:, None] * GP + rows[None, :]  # [C, R]
    m = tl.load(m_ptr + stat, mask=real, other=float("-inf"), cache_modifier=CACHE)
    weight = tl.exp(m - top[None, :])  # [C, R]; 0 for an empty or absent split
    l_sum = weight * tl.load(l_ptr + stat, mask=real, other=0.0, cache_modifier=CACHE)
    acc = tl.load(
        acc_ptr + stat[:, :, None] * DP + dims[None, None, :],
        mask=real[:, :, None],
        other=0.0,
        cache_modifier=CACHE,
    )  # [C, R, DP]
    return l_sum, weight[:, :, None] * acc


@triton.jit
def merge_splits(
    m_ptr,
    l_ptr,
    acc_ptr,
    head,
    rows,
    dims,
    top,
    total,
    out,
    NS: tl.constexpr,
    DP: tl.constexpr,
    GP: tl.constexpr,
    CACHE: tl.constexpr = CACHED,
    AT_ONCE: tl.constexpr = SPLITS_AT_ONCE,
):
    """Merge head `head`'s NS splits into a state (top, total, out) whose max `top` already
    covers every split's m (see `splits_max`) → (total, out) rescaled to `top`. A split holds GP
    query rows; `rows` are the first of them the caller merges (the real ones: the padding the
    matrix units needed in the splits is not read). CACHE: the loads' cache modifier (".cg" reads
    past the SM's L1, for states other programs of the same launch wrote). AT_ONCE: the splits
    a step merges (fewer hold fewer registers)."""
    totals, outs = _weighted_tile(
        m_ptr, l_ptr, acc_ptr, head, rows, dims, top, 0, NS, DP, GP, CACHE, AT_ONCE
    )  # [C, R], [C, R, DP]
    for first in tl.static_range(AT_ONCE, NS, AT_ONCE):
        l_sum, acc = _weighted_tile(
            m_ptr, l_ptr, acc_ptr, head, rows, dims, top, first, NS, DP, GP, CACHE, AT_ONCE
        )
        totals += l_sum
        outs += acc
    return total + tl.sum(totals, axis=0), out + tl.sum(outs, axis=0)


@triton.jit
def _tile_max(
    m_ptr,
    head,
    rows,
    first,
    NS: tl.constexpr,
    GP: tl.constexpr,
    CACHE: tl.constexpr,
    C: tl.constexpr,
):
    """The running maxes [C, R] of splits first.. first + C (−inf past NS)."""
    splits = first + tl.arange(0, C)  # [C]
    stat = (head * NS + splits)[:, None] * GP + rows[None, :]  # [C, R]
    real = (splits < NS)[:, None]
    return tl.load(m_ptr + stat, mask=real, other=float("-inf"), cache_modifier=CACHE)


@triton.jit
def splits_max(
    m_ptr,
    head,
    rows,
    top,
    NS: tl.constexpr,
    GP: tl.constexpr,
    CACHE: tl.constexpr = CACHED,
    AT_ONCE: tl.constexpr = SPLITS_AT_ONCE,
):
    """The larger of `top` [R] and every split's running max (rows of GP stored per split)."""
    tops = _tile_max(m_ptr, head, rows, 0, NS, GP, CACHE, AT_ONCE)  # [C, R]
    for first in tl.static_range(AT_ONCE, NS, AT_ONCE):
        tops = tl.maximum(tops, _tile_max(m_ptr, head, rows, first, NS, GP, CACHE, AT_ONCE))
    return tl.maximum(top, tl.max(tops, axis=0))
