"""kv-quant's decode step on CUDA: attention straight from `IntCodec`'s grouped integer codes
and the new row encoded on the GPU, in turbo-quant's kernel path (`turbo_quant.kernel_path`:
the codes in fixed slots by plane, the exact sink and recent rows in a ring, the step's inputs
on the device, the whole step captured in a CUDA graph, sessions batched).

This module is the codec's half of that path: the launches `KernelPath` and
`BatchedKernelStep` call, with turbo-quant's signatures, over a store whose vectors are
[float16 scales ; float16 zero points ; packed codes] (the torch codec's bytes, laid out by
plane with a header of 4 bytes a group: `planes`). Per layer:

- (with `rotate`) turbo-quant's `_rotate_queries`: the queries into the codes' Walsh–Hadamard
  basis once, q·R;
- `_grouped_partial`: one program per (K/V head, split of the stored rows) and one more for the
  exact rows (turbo-quant's `_exact_state`, unchanged). A split decodes each row's codes in
  registers, group by group (index · scale + zero point, as `IntCodec.decode` does, rounded
  to the model's dtype as the torch path's decoded rows are), and runs the online softmax —
  products in the model's dtype, the state in float32. 4-bit codes are read as whole bytes and
  split into even and odd coordinates (two products over D/2), as turbo-quant's are. 4-bit
  codes in at most 4 groups a row skip the decode: the codes themselves go into the products,
  one masked product per group, and a group's affine map is applied to the scores and weights
  (score = Σ_g scale_g · (q_g · c_g) + zero_g · Σ q_g; a value's share
  Σ_b (p · scale_g)[b] · c_g[b] + Σ_b p[b] · zero_g[b]) — 1.13× the decoding form on an H100;
- `_grouped_combine`: two programs per K/V head: the splits' states merged (rotated back with
  `rotate`, R·R = I) with the exact rows' (turbo-quant's `_merged_output`), and the row leaving
  the exact ones encoded into its slot — the min–max of each group, the scale rounded to
  float16, codes rounded half to even, packed LSB first: `IntCodec.encode`'s bytes — while the
  new row goes among the exact ones (turbo-quant's `_leaving_row` / `_row_into_exact`).

The kernels take int2, int4 and int8 codes of a power-of-two coded width ≥ 16 cut into
power-of-two groups of ≥ 2 (a rotated row is padded to a power of two anyway; an unrotated head
of 64 or 128 qualifies); fp8 codes and other widths keep the torch path. A prompt's rows are
encoded by the torch codec on the device (the same bytes the torch path stores).

With `rotate` a coordinate within float32 rounding of a rounding boundary may land in the
neighbouring code: the kernel sums the rotation in a different order than torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from larql.kernels.dependent_launch import options as dependent_options
from larql.kernels.dependent_launch import wait_for_previous
from larql.kernels.online_softmax import block_update, soft_capped, store_split
from larql.kv.kv_quant.codecs import IntCodec, triton_codes
from larql.kv.turbo_quant import kernels as tq
from larql.kv.turbo_quant.kernels import (  # the path's shared pieces, and their launches'
    AT_CODES,
    AT_EXACT,
    AT_RING,
    AT_RING_SCALES,
    AT_SLOTS,
    FULL_LAYER_KEEP,
    META,
    Levers,
    Operands,
    Workspace,
    _exact_state,
    _indices,
    _leaving_row,
    _merged_output,
    _nibbles,
    _row_into_exact,
    _spread,
    single_meta,
)
from larql.kv.turbo_quant.rotation import rotation_matrix

__all__ = [
    "FULL_LAYER_KEEP",
    "META",
    "CodecTables",
    "Levers",
    "Operands",
    "Workspace",
    "attention",
    "batched_attention",
    "cuda_partial_kernel",
    "encode",
    "single_meta",
    "supports",
]

_MIN_DOT = 16  # tl.dot needs every dimension ≥ 16
TINY = tl.constexpr(1e-8)  # the codec's smallest scale (`codecs._TINY`)
# up to this many groups a row, each lane's scale and zero point are picked, not gathered
SELECT_GROUPS = tl.constexpr(4)


def supports(codec: object) -> bool:
    """The kernels take these codes (`codecs.triton_codes`)."""
    return triton_codes(codec)


@dataclass(frozen=True)
class CodecTables:
    """What the kernels need of an `IntCodec`, on the device (the fields `KernelPath` and
    `Workspace` read are turbo-quant's `CodecTables`')."""

    dim: int  # D, the head width
    rotated_dim: int  # D' = the coded width (D, or its power of two when rotated)
    bits: int
    group: int  # coordinates per scale and zero point
    groups: int  # groups a vector
    bytes_per_vector: int
    header_bytes: int  # the scales and zero points before the codes: 4 bytes a group
    rotate: bool
    rotation: torch.Tensor  # [D', D'] float32, R·R = I (the identity without `rotate`: unread)
    codec: IntCodec

    @staticmethod
    def of(codec: IntCodec, device: torch.device) -> CodecTables:
        width = codec.coded_dim
        if codec.rotate:
            rotation = rotation_matrix(width, torch.float32, device).contiguous()
        else:
            rotation = torch.eye(width, dtype=torch.float32, device=device)
        return CodecTables(
            dim=codec.dim,
            rotated_dim=width,
            bits=codec.bits,
            group=codec.group,
            groups=codec.groups,
            bytes_per_vector=codec.bytes_per_vector,
            header_bytes=4 * codec.groups,
            rotate=codec.rotate,
            rotation=rotation,
            codec=codec,
        )


@triton.jit
def _header_tile(header_ptr, at, present, NG: tl.constexpr):
    """The headers (float16 [NG scales ; NG zero points]) of the vectors beginning at `at` [B],
    one contiguous load a vector → [B, 2·NG] float32, 0 where not `present`."""
    cols = tl.arange(0, 2 * NG)
    tile = tl.load(header_ptr + at[:, None] + cols[None, :], mask=present[:, None], other=0.0)
    return tile.to(tl.float32)


@triton.jit
def _group_affine(tile, g, NG: tl.constexpr):
    """Group g's (scale, zero) [B] float32 from a header tile [B, 2·NG] (`_header_tile`)."""
    cols = tl.arange(0, 2 * NG)[None, :]
    scale = tl.sum(tl.where(cols == g, tile, 0.0), axis=1)
    zero = tl.sum(tl.where(cols == NG + g, tile, 0.0), axis=1)
    return scale, zero


@triton.jit
def _affine(header_ptr, at, present, group_of, NG: tl.constexpr, B: tl.constexpr, W: tl.constexpr):
    """The scale and zero point of each lane's group for the vectors whose headers (float16
    [NG scales ; NG zero points]) begin at `at` [B] → (scale, zero) [B, W] float32, 0 where
    not `present` (so an absent row decodes to 0 whatever its slot holds). group_of [W]: each
    lane's group. Few groups: each lane picks its group's (loaded once a row); many: gathered."""
    if NG <= SELECT_GROUPS:
        tile = _header_tile(header_ptr, at, present, NG)  # [B, 2·NG]: one load a vector
        s, z = _group_affine(tile, NG - 1, NG)  # the last group's, then each other picks its own
        scale = tl.broadcast_to(s[:, None], [B, W])
        zero = tl.broadcast_to(z[:, None], [B, W])
        for g in tl.static_range(NG - 1):
            s, z = _group_affine(tile, g, NG)
            pick = (group_of == g)[None, :]
            scale = tl.where(pick, s[:, None], scale)
            zero = tl.where(pick, z[:, None], zero)
    else:
        where = at[:, None] + group_of[None, :]
        mask = present[:, None] & (group_of >= 0)[None, :]
        scale = tl.load(header_ptr + where, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(header_ptr + where + NG, mask=mask, other=0.0).to(tl.float32)
    return scale, zero


@triton.jit
def _query_lanes(
    q_ptr, q_rot_ptr, rows, cols, real, D: tl.constexpr, DP: tl.constexpr, ROTATE: tl.constexpr
):
    """The group's queries at columns `cols` [W] → [GP, W] float32 (0 on padded rows): rotated
    (q·R, from the rotation launch) with ROTATE, else as projected."""
    if ROTATE:
        return tl.load(q_rot_ptr + rows[:, None] * DP + cols[None, :], mask=real, other=0.0)
    return tl.load(q_ptr + rows[:, None] * D + cols[None, :], mask=real, other=0.0).to(tl.float32)


@triton.jit
def _code_bias(dot: tl.constexpr):
    """What `_biased_codes` adds to a 4-bit code in the products' dtype `dot`: 128 in
    bfloat16, 1024 in float16 (the codes become the low mantissa bits of a power of two), 0 in
    float32."""
    if dot == tl.bfloat16:
        return 128.0
    elif dot == tl.float16:
        return 1024.0
    else:
        return 0.0


@triton.jit
def _biased_codes(codes, dot: tl.constexpr):
    """4-bit codes [B, W] int32 → code + `_code_bias` in the products' dtype `dot`, exactly: in
    16 bits the code ORed into the mantissa of 128 (bfloat16) or 1024 (float16) and the bits
    read as that dtype — integer logic instead of an int-to-float conversion per code."""
    if dot == tl.bfloat16:
        return (codes | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif dot == tl.float16:
        return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        return codes.to(dot)


@triton.jit
def _group_scores(q, codes, in_group):
    """q [GP, W] (dot dtype) against biased codes [B, W] (dot dtype, each code + the dtype's
    `_code_bias`: `_biased_codes`) on one group's lanes (in_group [1, W]) → (q_g · c_g [GP, B]
    float32, Σ q_g [GP] float32), the bias taken back out: q_g · (c + bias) − bias · Σ q_g."""
    q_g = tl.where(in_group, q, tl.zeros_like(q))
    dots = tl.dot(q_g, tl.trans(codes), input_precision="ieee")
    q_sum = tl.sum(q_g.to(tl.float32), axis=1)
    return dots - _code_bias(q.dtype) * q_sum[:, None], q_sum


@triton.jit
def _group_values(weights, codes, in_group, scale, zero, DOT: tl.constexpr):
    """Σ_b p[r, b] · (c[b, lane] · scale[b] + zero[b]) on one group's lanes (0 on the others),
    as Σ_b (p · scale)[r, b] · c[b, lane] + Σ_b p[r, b] · zero[b]: weights p [GP, B] float32,
    biased codes [B, W] in DOT's dtype (c + bias: `_biased_codes`), in_group [1, W], scale and
    zero [B] → [GP, W] float32. The bias comes back out through the weights as the product
    rounded them (Σ_b round(p · scale)[b] · bias)."""
    scaled = (weights * scale[None, :]).to(DOT)
    part = tl.dot(scaled, codes, input_precision="ieee")
    bias = _code_bias(DOT)
    shift = tl.sum(weights * zero[None, :] - bias * scaled.to(tl.float32), axis=1)  # [GP]
    return tl.where(in_group, part + shift[:, None], 0.0)


@triton.jit
def _grouped_split_state(
    q_ptr,
    q_rot_ptr,
    codes_ptr,
    header_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    stat_slot,
    split,
    head,
    slots,
    pos,
    keep,
    scale,
    softcap,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    HKV: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr,
    BPV: tl.constexpr,
    HDR: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    NG: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    RECENT: tl.constexpr,
    WRAPS: tl.constexpr,
    NIBBLES: tl.constexpr,
    ROTATE: tl.constexpr,
    FACTORED: tl.constexpr,
):
    """Split `split`'s softmax state over its coded rows of K/V head `head` (q_ptr: its group's
    queries; q_rot_ptr: the same rotated), stored at state `stat_slot`, in the codes' basis."""
    rows = tl.arange(0, GP)
    dims = tl.arange(0, DP)
    lanes = tl.arange(0, DP // 2)
    end_coded = tl.maximum(pos - RECENT, 0)  # the codes are tokens [first_coded, end_coded)
    first_coded = tl.maximum(pos - keep, SINKS)
    filled = tl.minimum(end_coded, slots)  # slots written so far
    payload: tl.constexpr = BPV - HDR  # code bytes a vector
    halves: tl.constexpr = HDR // 2  # float16s of a header
    key_plane = head * slots  # the key's plane's first vector (`planes`), the value's HKV later
    headers_at = HKV * slots * payload  # (float16s) every plane's codes come first
    split_first = split * BLOCKS_PER_SPLIT * BLOCK
    blocks = tl.minimum(tl.maximum(filled - split_first + BLOCK - 1, 0) // BLOCK, BLOCKS_PER_SPLIT)
    real = (rows < G)[:, None]
    if blocks == 0:  # no coded row in this split: the empty state
        store_split(
            m_ptr,
            l_ptr,
            acc_ptr,
            stat_slot,
            rows,
            dims,
            tl.full([GP], float("-inf"), tl.float32),
            tl.zeros([GP], tl.float32),
            tl.zeros([GP, DP], tl.float32),
            DP,
        )
    else:
        dot_dtype = q_ptr.dtype.element_ty
        if NIBBLES:
            q_even = _query_lanes(q_ptr, q_rot_ptr, rows, 2 * lanes, real, D, DP, ROTATE)
            q_odd = _query_lanes(q_ptr, q_rot_ptr, rows, 2 * lanes + 1, real, D, DP, ROTATE)
            q_even = q_even.to(dot_dtype)  # [GP, DP/2]
            q_odd = q_odd.to(dot_dtype)
            lane_group = (2 * lanes) // GROUP  # coordinates 2j and 2j + 1 share a group
            acc_even = tl.zeros([GP, DP // 2], tl.float32)
            acc_odd = tl.zeros([GP, DP // 2], tl.float32)
        else:
            q = _query_lanes(q_ptr, q_rot_ptr, rows, dims, real, D, DP, ROTATE).to(dot_dtype)
            dim_group = dims // GROUP
            acc = tl.zeros([GP, DP], tl.float32)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        for b in tl.range(0, blocks, num_stages=STAGES):  # not unrolled: deep stores compile fast
            slot = split_first + b * BLOCK + tl.arange(0, BLOCK)
            token = slot  # the slot's latest token
            if WRAPS:
                token = slot + slots * ((end_coded - 1 - slot) // slots)
            present = (slot < filled) & (token >= first_coded) & (token < end_coded)
            vector = key_plane + tl.minimum(slot, slots - 1)  # in bounds
            key_starts = vector * payload
            value_starts = key_starts + HKV * slots * payload
            key_headers = headers_at + vector * halves
            value_headers = key_headers + HKV * slots * halves
            read = slot >= 0  # every code byte is read; the headers only where present
            if FACTORED:  # s = Σ_g scale_g · (q_g · c_g) + zero_g · Σ q_g: codes into the dot
                even, odd = _nibbles(codes_ptr, key_starts, read, lanes)  # [B, DP/2] each
                even, odd = _biased_codes(even, dot_dtype), _biased_codes(odd, dot_dtype)
                s = tl.zeros([GP, BLOCK], tl.float32)
                k_header = _header_tile(header_ptr, key_headers, present, NG)  # [B, 2·NG]
                for g in tl.static_range(NG):
                    k_scale, k_zero = _group_affine(k_header, g, NG)
                    in_group = (lane_group == g)[None, :]
                    dots, q_sum = _group_scores(q_even, even, in_group)
                    dots_odd, q_sum_odd = _group_scores(q_odd, odd, in_group)
                    q_sum += q_sum_odd
                    s += (dots + dots_odd) * k_scale[None, :] + q_sum[:, None] * k_zero[None, :]
            elif NIBBLES:
                k_scale, k_zero = _affine(
                    header_ptr, key_headers, present, lane_group, NG, BLOCK, DP // 2
                )
                even, odd = _nibbles(codes_ptr, key_starts, read, lanes)  # [B, DP/2] each
                k_even = (even.to(tl.float32) * k_scale + k_zero).to(dot_dtype)
                k_odd = (odd.to(tl.float32) * k_scale + k_zero).to(dot_dtype)
                s = tl.dot(q_even, tl.trans(k_even), input_precision="ieee")
                s += tl.dot(q_odd, tl.trans(k_odd), input_precision="ieee")
            else:
                k_scale, k_zero = _affine(
                    header_ptr, key_headers, present, dim_group, NG, BLOCK, DP
                )
                index = _indices(codes_ptr, key_starts, read, dims, BITS, BPV)  # [B, DP]
                keys = (index.to(tl.float32) * k_scale + k_zero).to(dot_dtype)
                s = tl.dot(q, tl.trans(keys), input_precision="ieee")
            s = s * scale  # [GP, B]
            m_i, l_i, p, alpha = block_update(m_i, l_i, soft_capped(s, softcap, SOFTCAP), present)
            weights = p.to(dot_dtype)
            if FACTORED:  # Σ_b p·(c·scale + zero) = Σ_b (p·scale)·c + Σ_b p·zero, per group
                even, odd = _nibbles(codes_ptr, value_starts, read, lanes)
                even, odd = _biased_codes(even, dot_dtype), _biased_codes(odd, dot_dtype)
                acc_even = acc_even * alpha[:, None]
                acc_odd = acc_odd * alpha[:, None]
                v_header = _header_tile(header_ptr, value_headers, present, NG)
                for g in tl.static_range(NG):
                    v_scale, v_zero = _group_affine(v_header, g, NG)
                    in_group = (lane_group == g)[None, :]
                    acc_even += _group_values(p, even, in_group, v_scale, v_zero, dot_dtype)
                    acc_odd += _group_values(p, odd, in_group, v_scale, v_zero, dot_dtype)
            elif NIBBLES:
                v_scale, v_zero = _affine(
                    header_ptr, value_headers, present, lane_group, NG, BLOCK, DP // 2
                )
                even, odd = _nibbles(codes_ptr, value_starts, read, lanes)
                v_even = (even.to(tl.float32) * v_scale + v_zero).to(dot_dtype)
                v_odd = (odd.to(tl.float32) * v_scale + v_zero).to(dot_dtype)
                acc_even = acc_even * alpha[:, None] + tl.dot(
                    weights, v_even, input_precision="ieee"
                )
                acc_odd = acc_odd * alpha[:, None] + tl.dot(weights, v_odd, input_precision="ieee")
            else:
                v_scale, v_zero = _affine(
                    header_ptr, value_headers, present, dim_group, NG, BLOCK, DP
                )
                index = _indices(codes_ptr, value_starts, read, dims, BITS, BPV)
                values = (index.to(tl.float32) * v_scale + v_zero).to(dot_dtype)
                acc = acc * alpha[:, None] + tl.dot(weights, values, input_precision="ieee")
        if NIBBLES:  # the state holds the coordinates in order
            stat = stat_slot * GP + rows
            tl.store(m_ptr + stat, m_i)
            tl.store(l_ptr + stat, l_i)
            tl.store(acc_ptr + stat[:, None] * DP + (2 * lanes)[None, :], acc_even)
            tl.store(acc_ptr + stat[:, None] * DP + (2 * lanes + 1)[None, :], acc_odd)
        else:
            store_split(m_ptr, l_ptr, acc_ptr, stat_slot, rows, dims, m_i, l_i, acc, DP)


@triton.jit
def _grouped_partial(
    q_ptr,  # [B, Hq, D] model dtype
    q_rot_ptr,  # [B, Hq, DP] float32: q·R (ROTATE: `_rotate_queries`)
    k_new_ptr,  # [B, Hkv, D] the new token's exact key
    v_new_ptr,  # [B, Hkv, D]
    codes_ptr,  # uint8 [slots, row_bytes], the store (by plane: `planes`)
    header_ptr,  # float16 view of the same bytes
    exact_ptr,  # [E, 2, Hkv, D] 16-bit: sinks, then the ring of recent rows (RING8: sinks only)
    ring_ptr,  # RING8: int8 [RING, 2, Hkv, D], the ring of recent rows
    ring_scale_ptr,  # RING8: float16 [RING, 2, Hkv], their scales
    meta_ptr,  # [B, META] int64: each session's offsets from the pointers above, its slots
    pos_ptr,  # [B] int64: each session's new token's position
    m_ptr,  # [B·Hkv, NS + 1, GP] float32 (at the workspace's front)
    l_ptr,
    acc_ptr,  # [B·Hkv, NS + 1, GP, DP] float32
    keep,  # rows before its own a query sees
    scale,
    softcap,
    G: tl.constexpr,
    GP: tl.constexpr,
    R: tl.constexpr,  # the exact rows' program's query rows
    D: tl.constexpr,
    DP: tl.constexpr,
    HKV: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr,
    NS: tl.constexpr,
    BPV: tl.constexpr,
    HDR: tl.constexpr,  # header bytes a vector: NG float16 scales, NG float16 zero points
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    NG: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    RECENT: tl.constexpr,
    RING: tl.constexpr,
    EP: tl.constexpr,
    EC: tl.constexpr,
    RING8: tl.constexpr,
    WRAPS: tl.constexpr,
    NIBBLES: tl.constexpr,  # 4-bit codes: read as bytes, split even / odd
    ROTATE: tl.constexpr,  # the codes in the Walsh–Hadamard basis
    FACTORED: tl.constexpr,  # 4-bit: the scales and zero points applied outside the dots
    PDL: tl.constexpr = False,  # launched with `dependent_launch.options`
):
    """Programs 0 … NS − 1 of a (K/V head, session): a split's state over its coded rows;
    program NS: the exact rows' state (turbo-quant's `_exact_state`)."""
    wait_for_previous(PDL)
    head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    pair = seq * HKV + head  # the workspace's (sequence, K/V head)
    first_state = pair * (NS + 1)  # its states: the NS splits', then the exact rows'
    state = meta_ptr + seq * META
    codes_at = tl.multiple_of(tl.load(state + AT_CODES), 16)
    slots = tl.load(state + AT_SLOTS).to(tl.int32)
    pos = tl.load(pos_ptr + seq).to(tl.int32)
    if split == NS:
        _exact_state(
            q_ptr + seq * (HKV * G * D),
            k_new_ptr + seq * (HKV * D),
            v_new_ptr + seq * (HKV * D),
            exact_ptr + tl.load(state + AT_EXACT),
            ring_ptr + tl.load(state + AT_RING),
            ring_scale_ptr + tl.load(state + AT_RING_SCALES),
            m_ptr,
            l_ptr,
            acc_ptr,
            (first_state + NS) * GP,
            pos,
            keep,
            head,
            scale,
            softcap,
            G,
            R,
            D,
            DP,
            HKV,
            SOFTCAP,
            SINKS,
            RECENT,
            RING,
            EP,
            EC,
            RING8,
        )
    else:
        _grouped_split_state(
            q_ptr + seq * (HKV * G * D) + head * (G * D),
            q_rot_ptr + (seq * HKV * G + head * G) * DP,
            codes_ptr + codes_at,
            header_ptr + codes_at // 2,
            m_ptr,
            l_ptr,
            acc_ptr,
            first_state + split,
            split,
            head,
            slots,
            pos,
            keep,
            scale,
            softcap,
            G,
            GP,
            D,
            DP,
            HKV,
            BLOCKS_PER_SPLIT,
            BPV,
            HDR,
            BITS,
            GROUP,
            NG,
            BLOCK,
            STAGES,
            SOFTCAP,
            SINKS,
            RECENT,
            WRAPS,
            NIBBLES,
            ROTATE,
            FACTORED,
        )


@triton.jit
def _nearest_even(x):
    """x rounded to the nearest integer, ties to even (torch.round)."""
    nearest = tl.floor(x + 0.5)
    odd = (nearest - 2.0 * tl.floor(nearest * 0.5)) != 0.0
    return tl.where((nearest - x == 0.5) & odd, nearest - 1.0, nearest)


@triton.jit
def _store_grouped(
    codes_ptr,
    header_ptr,
    start,
    header_at,
    x,
    rotation,
    write,
    DP: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    NG: tl.constexpr,
    ROTATE: tl.constexpr,
):
    """One vector x [DP] float32 (0 past D), where `write`, encoded as `IntCodec.encode` does:
    rotated (x·R) with ROTATE; per group the scale (max − min) / (2^BITS − 1) rounded to
    float16 (at least TINY) and the zero point min rounded to float16; codes round((x − zero)
    / scale) within [0, 2^BITS − 1], packed LSB first from byte offset `start`; the scales then
    the zero points (float16) from float16 offset `header_at`."""
    if ROTATE:
        x = tl.sum(x[:, None] * rotation, axis=0)  # [DP] = x·R
    grouped = tl.reshape(x, [NG, GROUP])
    low = tl.min(grouped, axis=1)  # [NG]
    high = tl.max(grouped, axis=1)
    levels: tl.constexpr = (1 << BITS) - 1
    scale = tl.math.div_rn(high - low, low * 0.0 + levels).to(tl.float16).to(tl.float32)
    scale = tl.maximum(scale, TINY)
    zero16 = low.to(tl.float16)
    ratio = tl.math.div_rn(grouped - zero16.to(tl.float32)[:, None], scale[:, None] + grouped * 0.0)
    codes = tl.minimum(tl.maximum(_nearest_even(ratio), 0.0), levels * 1.0).to(tl.int32)
    per_byte: tl.constexpr = 8 // BITS
    if per_byte == 1:
        packed_bytes = tl.reshape(codes, [DP])
    else:
        packed = tl.reshape(codes, [DP // per_byte, per_byte])
        shift = tl.arange(0, per_byte) * BITS
        packed_bytes = tl.sum(packed << shift[None, :], axis=1)  # disjoint bits: sum = or
    lanes = tl.arange(0, DP // per_byte)
    tl.store(codes_ptr + start + lanes, packed_bytes.to(tl.uint8), mask=_spread(write, lanes))
    groups = tl.arange(0, NG)
    kept = _spread(write, groups)
    tl.store(header_ptr + header_at + groups, scale.to(tl.float16), mask=kept)
    tl.store(header_ptr + header_at + NG + groups, zero16, mask=kept)


@triton.jit
def _grouped_combine(
    rot_ptr,  # [DP, DP] float32 (ROTATE)
    k_new_ptr,  # [B, Hkv, D] the new token's exact key
    v_new_ptr,  # [B, Hkv, D]
    codes_ptr,  # uint8 [slots, row_bytes], the store (by plane): the leaving row goes here
    header_ptr,  # float16 view of the same bytes
    exact_ptr,  # [E, 2, Hkv, D] 16-bit: sinks, then the ring of recent rows (RING8: sinks only)
    ring_ptr,  # RING8: int8 [RING, 2, Hkv, D]
    ring_scale_ptr,  # RING8: float16 [RING, 2, Hkv]
    meta_ptr,  # [B, META] int64
    pos_ptr,  # [B] int64
    m_ptr,  # the partial launch's states: [B·Hkv, NS + 1, GP(, DP)] float32
    l_ptr,
    acc_ptr,
    out_ptr,  # [B, Hq, D] model dtype
    G: tl.constexpr,
    GP: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    HKV: tl.constexpr,
    NS: tl.constexpr,
    BPV: tl.constexpr,
    HDR: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    NG: tl.constexpr,
    SINKS: tl.constexpr,
    RECENT: tl.constexpr,
    RING: tl.constexpr,
    EP: tl.constexpr,
    RING8: tl.constexpr,
    ROTATE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Role 0 of a (K/V head, session): the attention from the partial states; role 1: the row
    leaving the exact ones encoded into its slot, the new row among the exact ones."""
    wait_for_previous(PDL)
    head = tl.program_id(0)
    role = tl.program_id(1)
    seq = tl.program_id(2)
    pair = seq * HKV + head
    state = meta_ptr + seq * META
    codes_at = tl.multiple_of(tl.load(state + AT_CODES), 16)
    slots = tl.load(state + AT_SLOTS).to(tl.int32)
    pos = tl.load(pos_ptr + seq).to(tl.int32)
    rows = tl.arange(0, R)
    dims = tl.arange(0, DP)
    within = dims < D
    if ROTATE:
        rotation = tl.load(rot_ptr + dims[:, None] * DP + dims[None, :])  # [DP, DP]
    else:
        rotation = tl.zeros([DP, DP], tl.float32)  # (unread)
    if role == 0:
        _merged_output(
            rotation,
            m_ptr,
            l_ptr,
            acc_ptr,
            out_ptr + seq * (HKV * G * D),
            pair,
            head,
            rows,
            dims,
            within,
            G,
            GP,
            R,
            D,
            DP,
            NS,
            ROTATE,
        )
    else:
        exact_ptr += tl.load(state + AT_EXACT)
        ring_ptr += tl.load(state + AT_RING)
        ring_scale_ptr += tl.load(state + AT_RING_SCALES)
        k_new = tl.load(k_new_ptr + seq * (HKV * D) + head * D + dims, mask=within, other=0.0)
        v_new = tl.load(v_new_ptr + seq * (HKV * D) + head * D + dims, mask=within, other=0.0)
        k_new = k_new.to(tl.float32)
        v_new = v_new.to(tl.float32)
        token, key, value = _leaving_row(
            k_new,
            v_new,
            exact_ptr,
            ring_ptr,
            ring_scale_ptr,
            exact_ptr,  # (no centering: no mean rows)
            pos,
            head,
            dims,
            within,
            D,
            HKV,
            SINKS,
            RECENT,
            RING,
            False,
            RING8,
        )
        write = (token >= SINKS) & (token >= 0)  # a scalar
        payload: tl.constexpr = BPV - HDR
        halves: tl.constexpr = HDR // 2
        codes_ptr += codes_at
        header_ptr += codes_at // 2
        k_at = head * slots + tl.maximum(token, 0) % slots  # the key's vector in the planes
        v_at = k_at + HKV * slots
        headers_at = HKV * slots * payload  # (float16s) after every plane's codes
        _store_grouped(
            codes_ptr,
            header_ptr,
            k_at * payload,
            headers_at + k_at * halves,
            key,
            rotation,
            write,
            DP,
            BITS,
            GROUP,
            NG,
            ROTATE,
        )
        _store_grouped(
            codes_ptr,
            header_ptr,
            v_at * payload,
            headers_at + v_at * halves,
            value,
            rotation,
            write,
            DP,
            BITS,
            GROUP,
            NG,
            ROTATE,
        )
        _row_into_exact(
            k_new,
            v_new,
            exact_ptr,
            ring_ptr,
            ring_scale_ptr,
            pos,
            head,
            dims,
            within,
            D,
            HKV,
            SINKS,
            RECENT,
            RING,
            EP,
            RING8,
        )


def _factored(tables: CodecTables) -> bool:
    """4-bit codes in few groups: one masked product per group over the codes themselves, the
    scales and zero points applied to the scores and weights; else each row decoded first."""
    return tables.bits == 4 and tables.rotated_dim >= 2 * _MIN_DOT and tables.groups <= 4


def cuda_partial_kernel(*_: object) -> None:
    """turbo-quant's CUDA C++ partial launch reads its codebook's codes only: none here."""
    return None


def attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    codes: torch.Tensor,
    position: torch.Tensor,
    tables: CodecTables,
    scale: float,
    softcap: float = 0.0,
    workspace: Workspace | None = None,
    levers: Levers | None = None,
    meta: torch.Tensor | None = None,
    use_cuda_partial: bool = True,
) -> torch.Tensor:
    """One decode step of one layer (turbo-quant's `attention`'s contract): q [Hq, 1, D] over
    the coded rows in `codes` (uint8 [slots, row_bytes] by plane; token t in slot t mod slots),
    the exact rows of `levers` and the new row k_new, v_new [Hkv, 1, D]; then the row leaving
    the exact ones is encoded into its slot and the new row kept exact. position: [1] int64 on
    the device. → [Hq, 1, D] in q's dtype."""
    heads, _, dim = q.shape
    kv_heads = k_new.shape[0]
    if levers is None:
        levers = Levers.none(kv_heads, tables, q.device)  # type: ignore[arg-type]
    assert codes.is_contiguous() and codes.shape[1] == 2 * kv_heads * tables.bytes_per_vector
    if meta is None:
        meta = single_meta(codes)
    out = batched_attention(
        q.reshape(1, heads, dim),
        k_new.reshape(1, kv_heads, dim),
        v_new.reshape(1, kv_heads, dim),
        Operands.of(codes, levers),
        meta,
        position,
        codes.shape[0],
        tables,
        scale,
        softcap,
        workspace,
        levers,
    )
    return out.view(heads, 1, dim)


def batched_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    operands: Operands,
    meta: torch.Tensor,
    positions: torch.Tensor,
    max_slots: int,
    tables: CodecTables,
    scale: float,
    softcap: float = 0.0,
    workspace: Workspace | None = None,
    levers: Levers | None = None,
    n_splits: int | None = None,
    use_cuda_partial: bool = True,
) -> torch.Tensor:
    """One decode step of one layer for B sessions (turbo-quant's `batched_attention`'s
    contract: session b's state reached from `operands` by the offsets in meta[b]). q:
    [B, Hq, D], k_new, v_new: [B, Hkv, D]; `use_cuda_partial` is not used (no CUDA C++ launch
    reads these codes). → [B, Hq, D]."""
    batch, heads, dim = q.shape
    kv_heads = k_new.shape[1]
    group = heads // kv_heads
    dp = tables.rotated_dim
    assert operands.codes.is_contiguous()
    if workspace is None:
        workspace = Workspace.of(heads, kv_heads, tables, q.device, batch)  # type: ignore[arg-type]
    assert workspace.m.shape[0] >= batch * kv_heads, "a workspace too small for the batch"
    if levers is None:
        levers = Levers.none(kv_heads, tables, q.device)  # type: ignore[arg-type]
    assert not levers.center, "kv-quant's codes are not centered"
    constants = levers.constants()
    combine_rows = tq._combine_rows(group, dp, int(constants["EC"]))
    gp = workspace.m.shape[-1]
    assert gp >= max(group, combine_rows), "a workspace made for fewer query rows"
    row_bytes = 2 * kv_heads * tables.bytes_per_vector
    assert tq.launch_indices_fit(max_slots, row_bytes), "a store past 2 GiB needs 64-bit indices"
    q, k_new, v_new = q.contiguous(), k_new.contiguous(), v_new.contiguous()
    headers = operands.codes.view(torch.float16)
    if n_splits is None:
        n_splits = tq.batch_splits(max_slots, batch * kv_heads)
    per_split = tq._next_power_of_two(max(1, -(-max_slots // (tq.BLOCK_N * n_splits))))
    shape = {"G": group, "GP": gp, "D": dim, "DP": dp, "HKV": kv_heads}
    codec = {
        "BPV": tables.bytes_per_vector,
        "HDR": tables.header_bytes,
        "BITS": tables.bits,
        "GROUP": tables.group,
        "NG": tables.groups,
        "ROTATE": tables.rotate,
    }
    exact_rows = {key: constants[key] for key in ("SINKS", "RECENT", "RING", "EP", "RING8")}
    if tables.rotate:
        tq._rotate_queries[(kv_heads, batch)](
            q,
            tables.rotation,
            workspace.queries,
            G=group,
            GP=gp,
            D=dim,
            DP=dp,
            HKV=kv_heads,
            PRECISION=tq.precision(q.dtype),
            **dependent_options(q.device),
        )
    _grouped_partial[(kv_heads, n_splits + 1, batch)](
        q,
        workspace.queries,
        k_new,
        v_new,
        operands.codes,
        headers,
        operands.exact,
        operands.ring,
        operands.ring_scales,
        meta,
        positions,
        workspace.m,
        workspace.l_sum,
        workspace.acc,
        levers.keep,
        scale,
        softcap,
        **shape,
        **codec,
        **exact_rows,
        R=combine_rows,
        EC=constants["EC"],
        BLOCKS_PER_SPLIT=per_split,
        NS=n_splits,
        BLOCK=tq.BLOCK_N,
        STAGES=tq.STAGES,
        SOFTCAP=softcap > 0.0,
        WRAPS=levers.keep != FULL_LAYER_KEEP,
        NIBBLES=tables.bits == 4 and dp >= 2 * _MIN_DOT,
        FACTORED=_factored(tables),
        num_warps=tq.PARTIAL_WARPS,
        **dependent_options(q.device),
    )
    out = torch.empty((batch, heads, dim), dtype=q.dtype, device=q.device)
    _grouped_combine[(kv_heads, 2, batch)](
        tables.rotation,
        k_new,
        v_new,
        operands.codes,
        headers,
        operands.exact,
        operands.ring,
        operands.ring_scales,
        meta,
        positions,
        workspace.m,
        workspace.l_sum,
        workspace.acc,
        out,
        **shape,
        **codec,
        **exact_rows,
        R=combine_rows,
        NS=n_splits,
        num_warps=tq.COMBINE_WARPS,
        **dependent_options(q.device),
    )
    return out


def encode(x: torch.Tensor, tables: CodecTables, mean: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, D] (a prompt's rows) → uint8 [N, bytes_per_vector], by the torch codec on x's
    device: the bytes the torch path stores."""
    assert mean is None, "kv-quant's codes are not centered"
    return tables.codec.encode(x)
