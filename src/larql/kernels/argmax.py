"""Each row's argmax of a few rows of logits on CUDA, in two short launches: the greedy pick of a
decode step. torch's argmax over one 128,256-wide row ran as one long reduction (26 µs in a CUDA
graph on an H200, the step ~1 ms); here many programs each take a chunk of the row and a second
launch picks among their winners (2.2 µs).

The pick is torch's: the first of equal maxima, a NaN above everything (the first NaN if there
are several), −0.0 equal to +0.0. Each value is compared as an integer key that orders floats the
way `<` does: a float's bits as a signed integer are in order for non-negative values; for
negative ones the magnitude bits are flipped, so a larger magnitude is a smaller key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from larql.kernels.dependent_launch import options as dependent_options
from larql.kernels.dependent_launch import wait_for_previous

_CHUNK = 2048  # columns a first-launch program reduces
_NAN_KEY = tl.constexpr(2**31 - 1)  # above every number's key (+inf is 0x7F800000)
_ABSENT_KEY = tl.constexpr(-(2**31))  # below every number's key (−inf is −0x7F800001)


@triton.jit
def _ordered_keys(x):
    """float32 values → int32 keys in the same order as the values (torch's, NaN the largest)."""
    bits = x.to(tl.int32, bitcast=True)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative values: magnitude bits flipped
    keys = tl.where(x == 0.0, 0, keys)  # −0.0 == +0.0
    return tl.where(x != x, _NAN_KEY, keys)


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr,  # [B, V], the last dim contiguous
    keys_ptr,  # [B, P] int32: each chunk's largest key
    index_ptr,  # [B, P] int32: where it first is in the row
    width,  # V
    stride,
    chunks,  # P
    CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with `dependent_launch.options`
):
    wait_for_previous(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    present = cols < width
    x = tl.load(logits_ptr + row * stride + cols, mask=present, other=0.0).to(tl.float32)
    keys = tl.where(present, _ordered_keys(x), _ABSENT_KEY)  # [CHUNK]
    first = tl.argmax(keys, axis=0, tie_break_left=True)
    tl.store(keys_ptr + row * chunks + chunk, tl.max(keys, axis=0))
    tl.store(index_ptr + row * chunks + chunk, chunk * CHUNK + first)


@triton.jit
def _pick_kernel(
    keys_ptr,  # [B, P] int32
    index_ptr,  # [B, P] int32
    out_ptr,  # [B] int64
    chunks,  # P
    CHUNKS: tl.constexpr,  # P rounded up to a power of two
    PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    slots = tl.arange(0, CHUNKS)
    present = slots < chunks
    keys = tl.load(keys_ptr + row * chunks + slots, mask=present, other=_ABSENT_KEY)
    # the chunks are in column order, so the first chunk holding the largest key holds its
    # first column
    winner = tl.argmax(keys, axis=0, tie_break_left=True)
    index = tl.load(index_ptr + row * chunks + winner)
    tl.store(out_ptr + row, index.to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] (V < 2³¹) → each row's argmax as torch gives it, [B] int64, on the
    logits' device."""
    rows, width = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(width, _CHUNK)
    keys = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    index = torch.empty_like(keys)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    launch = dependent_options(logits.device)
    _chunk_argmax_kernel[(rows, chunks)](
        logits, keys, index, width, logits.stride(0), chunks, CHUNK=_CHUNK, num_warps=4, **launch
    )
    _pick_kernel[(rows,)](
        keys, index, out, chunks, CHUNKS=triton.next_power_of_2(chunks), num_warps=1, **launch
    )
    return out
