"""turbo-quant's decode step on CUDA in two launches per layer: attention straight from the
packed codes, and the new row encoded into the store by the launch that merges the attention.

The torch path decodes every stored row into a temporary ([n, D'] per head, ~10 launches), rotates
q and the new row, attends, rotates back and encodes the new row (~25 more launches: norm,
rotation, bucketize, bit packing, norm bytes). On a GPU at batch 1 those launches are the cost, not
the bytes. Here:

- `_attention_partial`: one program per (K/V head, split of the stored rows). It rotates the
  group's queries (q·R), unpacks each row's indices from the bit stream, looks up the centroids,
  scales by the row's norm and runs the online softmax in the rotated basis (where
  q·x = (q·R)·(x·R) since R is orthogonal and symmetric). Float32 throughout.
- `_attention_combine`: one program per K/V head. It encodes the new k and v rows (norm,
  x/‖x‖·R, bucketize against the codebook boundaries, LSB-first bit packing, the float32 norm in
  front: `TurboQuantCodec.encode`'s bytes) into the store, adds the exact new row to the
  attention, merges the splits and rotates the output back (·R), → [Hq, D] in the model's dtype.
- `_encode`: the same encoding for many vectors at once (a prompt's K/V), one program each.

The store is a fixed-capacity uint8 [slots, row_bytes] buffer per layer (the engine's
`CodeSlots`): token t lives in slot t mod slots, a stored token is [K head 0 … K head Hkv−1,
V head 0 … V head Hkv−1], each vector [norm f32][packed indices]. The step reads its position
from a device tensor: the min(position, slots) filled slots are the history, slot
position mod slots receives the new row. Every shape and address is fixed, so the step can be
captured in a CUDA graph. A layer with slots ≥ every position holds all rows; a sliding layer
with slots = window − 1 is a ring of the rows a later query can still see.

A coordinate within float32 rounding of a codebook boundary may land in the neighbouring cell:
the kernels sum the rotation in a different order than torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from larql.kernels.online_softmax import (
    block_update,
    merge_splits,
    soft_capped,
    splits_max,
    store_split,
)
from larql.kv.turbo_quant.codebook import codebook
from larql.kv.turbo_quant.codec import NORM_BYTES, TurboQuantCodec
from larql.kv.turbo_quant.rotation import rotation_matrix

BLOCK_N = 32  # stored rows per block
# A launch has `splits(slots)` programs per K/V head, each over BLOCKS_PER_SPLIT blocks, a power
# of two ≥ the slots need: both compile-time constants (loops Triton unrolls); blocks past the
# filled slots are skipped at run time. Deep stores get more programs: 16 per head is 48 on
# SmolLM2, a third of an H200's SMs, each walking 16 blocks at 8k rows.
MIN_SPLITS = 16
MAX_SPLITS = 64
_BLOCKS_PER_PROGRAM = 4  # the split count aims at this many blocks per program
COMBINE_WARPS = 8
PARTIAL_WARPS = 4
_MIN_DOT = 16  # tl.dot needs every dimension ≥ 16
NORM = tl.constexpr(NORM_BYTES)  # a kernel reads module globals only as constexprs


def supports(codec: TurboQuantCodec) -> bool:
    """The kernels take head widths tl.dot takes (D' ≥ 16) and vectors whose float32 norms stay
    4-byte aligned in the store."""
    return codec.rotated_dim >= _MIN_DOT and codec.bytes_per_vector % NORM_BYTES == 0


@dataclass(frozen=True)
class CodecTables:
    """What the kernels need of a `TurboQuantCodec`, on the device."""

    dim: int  # D, the head width
    rotated_dim: int  # D' = next power of two ≥ D
    bits: int
    bytes_per_vector: int
    rotation: torch.Tensor  # [D', D'] float32, symmetric, R·R = I
    centroids: torch.Tensor  # [2^bits] float32
    boundaries: torch.Tensor  # [2^bits − 1] float32

    @staticmethod
    def of(codec: TurboQuantCodec, device: torch.device) -> CodecTables:
        book = codebook(codec.rotated_dim, codec.bits, device)
        return CodecTables(
            dim=codec.dim,
            rotated_dim=codec.rotated_dim,
            bits=codec.bits,
            bytes_per_vector=codec.bytes_per_vector,
            rotation=rotation_matrix(codec.rotated_dim, torch.float32, device).contiguous(),
            centroids=book.centroids.contiguous(),
            boundaries=book.boundaries.contiguous(),
        )


@dataclass(frozen=True)
class Workspace:
    """The splits' partial softmax state, reused by every layer's launches (they run in stream
    order; a launch uses the first `splits(slots)`): m, l [Hkv, MAX_SPLITS, GP],
    acc [Hkv, MAX_SPLITS, GP, D'] float32."""

    m: torch.Tensor
    l_sum: torch.Tensor
    acc: torch.Tensor

    @staticmethod
    def of(heads: int, kv_heads: int, tables: CodecTables, device: torch.device) -> Workspace:
        gp = _group_rows(heads // kv_heads)
        f32 = {"dtype": torch.float32, "device": device}
        m = torch.empty((kv_heads, MAX_SPLITS, gp), **f32)
        acc = torch.empty((kv_heads, MAX_SPLITS, gp, tables.rotated_dim), **f32)
        return Workspace(m=m, l_sum=torch.empty_like(m), acc=acc)


@triton.jit
def _rotated_queries(
    q_ptr, rot_ptr, head, rows, dims, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr
):
    """The G query heads sharing K/V head `head`, rotated: [GP, DP] float32 (padded rows 0)."""
    q = tl.load(
        q_ptr + (head * G + rows)[:, None] * D + dims[None, :],
        mask=(rows < G)[:, None] & (dims < D)[None, :],
        other=0.0,
    ).to(tl.float32)
    rotation = tl.load(rot_ptr + dims[:, None] * DP + dims[None, :])  # [DP, DP]
    return tl.dot(q, rotation, input_precision="ieee")


@triton.jit
def _decoded_rows(
    codes_ptr,
    norms_ptr,
    centroids_ptr,
    starts,
    present,
    dims,
    BITS: tl.constexpr,
    BPV: tl.constexpr,
):
    """Rows whose vectors begin at byte offsets `starts` [B] → ‖x‖·centroids [B, DP] float32,
    in the rotated basis (0 where not `present`)."""
    bit = dims * BITS
    byte = NORM + bit // 8  # [DP]
    where = starts[:, None] + byte[None, :]  # [B, DP]
    low = tl.load(codes_ptr + where, mask=present[:, None], other=0).to(tl.int32)
    if 8 % BITS != 0:  # a 3-bit index may straddle two bytes
        spill = present[:, None] & ((byte + 1) < BPV)[None, :]
        low |= tl.load(codes_ptr + where + 1, mask=spill, other=0).to(tl.int32) << 8
    index = (low >> (bit % 8)[None, :]) & ((1 << BITS) - 1)
    values = tl.load(centroids_ptr + index)  # [B, DP]
    norms = tl.load(norms_ptr + starts // 4, mask=present, other=0.0)  # [B]
    return values * norms[:, None]


@triton.jit
def _attention_partial(
    q_ptr,  # [Hq, D] model dtype
    rot_ptr,  # [DP, DP] float32
    codes_ptr,  # uint8 [slots, row_bytes], the store
    norms_ptr,  # float32 view of the same bytes
    centroids_ptr,  # [2^BITS] float32
    pos_ptr,  # [1] int64: the new token's position
    m_ptr,  # [Hkv, NS, GP] float32
    l_ptr,
    acc_ptr,  # [Hkv, NS, GP, DP] float32
    slots,
    scale,
    softcap,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    HKV: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr,
    NS: tl.constexpr,
    BPV: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    head = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, GP)
    dims = tl.arange(0, DP)
    filled = tl.minimum(tl.load(pos_ptr), slots)  # slots holding history
    q = _rotated_queries(q_ptr, rot_ptr, head, rows, dims, G, D, DP)  # [GP, DP]
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    row_stride = 2 * HKV * BPV
    for b in tl.static_range(BLOCKS_PER_SPLIT):
        first = (split * BLOCKS_PER_SPLIT + b) * BLOCK
        if first < filled:
            slot = first + tl.arange(0, BLOCK)
            present = slot < filled
            key_starts = slot * row_stride + head * BPV
            keys = _decoded_rows(
                codes_ptr, norms_ptr, centroids_ptr, key_starts, present, dims, BITS, BPV
            )
            s = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale  # [GP, BLOCK]
            m_i, l_i, p, alpha = block_update(m_i, l_i, soft_capped(s, softcap, SOFTCAP), present)
            value_starts = key_starts + HKV * BPV
            values = _decoded_rows(
                codes_ptr, norms_ptr, centroids_ptr, value_starts, present, dims, BITS, BPV
            )
            acc = acc * alpha[:, None] + tl.dot(p, values, input_precision="ieee")
    store_split(m_ptr, l_ptr, acc_ptr, head * NS + split, rows, dims, m_i, l_i, acc, DP)


@triton.jit
def _encoded(x, rotation, boundaries_ptr, dims, DP: tl.constexpr, BITS: tl.constexpr):
    """One vector x [DP] float32 (0 past D) → (‖x‖, x/‖x‖·R [DP], its packed indices as
    words [DP / 8] uint32: word g holds indices 8g..8g+7, BITS bits each from the lowest, which
    are exactly bytes g·BITS .. g·BITS + BITS − 1 of the LSB-first stream)."""
    norm = tl.sqrt(tl.sum(x * x, axis=0))
    nonzero = norm > 1e-12
    unit = tl.where(nonzero, x / tl.where(nonzero, norm, 1.0), 0.0)
    y = tl.sum(unit[:, None] * rotation, axis=0)  # [DP] = unit·R
    index = tl.zeros_like(dims)  # [DP] int32
    for t in tl.static_range((1 << BITS) - 1):
        index += (y >= tl.load(boundaries_ptr + t)).to(tl.int32)
    groups = tl.reshape(index.to(tl.uint32), [DP // 8, 8])
    shift = (tl.arange(0, 8) * BITS).to(tl.uint32)
    words = tl.sum(groups << shift[None, :], axis=1)  # disjoint bits: sum = or
    return norm, y, words


@triton.jit
def _store_encoded(codes_ptr, norms_ptr, start, norm, words, DP: tl.constexpr, BITS: tl.constexpr):
    """A vector's bytes at byte offset `start` (a multiple of 4): [norm f32][packed indices]."""
    group = tl.arange(0, DP // 8)
    for k in tl.static_range(BITS):
        byte = (words >> (8 * k)) & 0xFF
        tl.store(codes_ptr + start + NORM + group * BITS + k, byte.to(tl.uint8))
    tl.store(norms_ptr + start // 4, norm)


@triton.jit
def _attention_combine(
    q_ptr,  # [Hq, D]
    rot_ptr,  # [DP, DP] float32
    boundaries_ptr,  # [2^BITS − 1] float32
    k_new_ptr,  # [Hkv, D] the new token's exact key
    v_new_ptr,  # [Hkv, D]
    codes_ptr,  # uint8 [slots, row_bytes], the store: the new row is written here
    norms_ptr,  # float32 view of the same bytes
    pos_ptr,  # [1] int64
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,  # [Hq, D] model dtype
    slots,
    scale,
    softcap,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    HKV: tl.constexpr,
    NS: tl.constexpr,
    BPV: tl.constexpr,
    BITS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    head = tl.program_id(0)
    rows = tl.arange(0, GP)
    dims = tl.arange(0, DP)
    q = _rotated_queries(q_ptr, rot_ptr, head, rows, dims, G, D, DP)  # [GP, DP]
    rotation = tl.load(rot_ptr + dims[:, None] * DP + dims[None, :])  # [DP, DP]
    new = head * D + dims
    k_new = tl.load(k_new_ptr + new, mask=dims < D, other=0.0).to(tl.float32)
    v_new = tl.load(v_new_ptr + new, mask=dims < D, other=0.0).to(tl.float32)
    k_norm, k_unit, k_words = _encoded(k_new, rotation, boundaries_ptr, dims, DP, BITS)
    v_norm, v_unit, v_words = _encoded(v_new, rotation, boundaries_ptr, dims, DP, BITS)
    slot = tl.load(pos_ptr) % slots
    key_start = slot * (2 * HKV * BPV) + head * BPV
    _store_encoded(codes_ptr, norms_ptr, key_start, k_norm, k_words, DP, BITS)
    _store_encoded(codes_ptr, norms_ptr, key_start + HKV * BPV, v_norm, v_words, DP, BITS)
    k_rot = k_unit * k_norm  # [DP] = k·R, exact (not quantised) for this step
    v_rot = v_unit * v_norm
    s_new = soft_capped(tl.sum(q * k_rot[None, :], axis=1) * scale, softcap, SOFTCAP)  # [GP]
    top = splits_max(m_ptr, head, rows, s_new, NS)
    total = tl.exp(s_new - top)  # the new row's state, then the splits'
    out = total[:, None] * v_rot[None, :]  # [GP, DP]
    total, out = merge_splits(m_ptr, l_ptr, acc_ptr, head, rows, dims, top, total, out, NS, DP)
    out = tl.dot(out / total[:, None], rotation, input_precision="ieee")  # back: ·R
    offsets = (head * G + rows)[:, None] * D + dims[None, :]
    mask = (rows < G)[:, None] & (dims < D)[None, :]
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _encode(
    x_ptr,  # [N, D] model dtype
    rot_ptr,  # [DP, DP] float32
    boundaries_ptr,  # [2^BITS − 1] float32
    codes_ptr,  # uint8 [N · BPV]
    norms_ptr,  # float32 view of the same bytes
    D: tl.constexpr,
    DP: tl.constexpr,
    BITS: tl.constexpr,
    BPV: tl.constexpr,
):
    vector = tl.program_id(0)
    dims = tl.arange(0, DP)
    x = tl.load(x_ptr + vector * D + dims, mask=dims < D, other=0.0).to(tl.float32)  # [DP]
    rotation = tl.load(rot_ptr + dims[:, None] * DP + dims[None, :])  # [DP, DP]
    norm, _, words = _encoded(x, rotation, boundaries_ptr, dims, DP, BITS)
    _store_encoded(codes_ptr, norms_ptr, vector * BPV, norm, words, DP, BITS)


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def splits(slots: int) -> int:
    """Programs per K/V head for a store of `slots` slots: a power of two in
    [MIN_SPLITS, MAX_SPLITS], aiming at _BLOCKS_PER_PROGRAM blocks each."""
    wanted = _next_power_of_two(max(1, slots // (BLOCK_N * _BLOCKS_PER_PROGRAM)))
    return min(MAX_SPLITS, max(MIN_SPLITS, wanted))


def _group_rows(group: int) -> int:
    """Query rows a program holds: the group, padded for tl.dot."""
    return max(_MIN_DOT, _next_power_of_two(group))


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
) -> torch.Tensor:
    """One decode step of one layer. q: [Hq, 1, D] attends over the min(position, slots) filled
    slots of `codes` (uint8 [slots, row_bytes], contiguous) followed by the exact new row
    k_new, v_new: [Hkv, 1, D], which is encoded into slot position mod slots.
    position: [1] int64 on the device. → [Hq, 1, D] in q's dtype."""
    heads, _, dim = q.shape
    kv_heads = k_new.shape[0]
    slots = codes.shape[0]
    group = heads // kv_heads
    dp = tables.rotated_dim
    assert codes.is_contiguous() and codes.shape[1] == 2 * kv_heads * tables.bytes_per_vector
    if workspace is None:
        workspace = Workspace.of(heads, kv_heads, tables, q.device)
    shape = {"G": group, "GP": _group_rows(group), "D": dim, "DP": dp}
    common = {"BPV": tables.bytes_per_vector, "BITS": tables.bits, "SOFTCAP": softcap > 0.0}
    q = q.reshape(heads, dim).contiguous()
    n_splits = splits(slots)
    per_split = _next_power_of_two(max(1, -(-slots // (BLOCK_N * n_splits))))
    _attention_partial[(kv_heads, n_splits)](
        q,
        tables.rotation,
        codes,
        codes.view(torch.float32),
        tables.centroids,
        position,
        workspace.m,
        workspace.l_sum,
        workspace.acc,
        slots,
        scale,
        softcap,
        **shape,
        **common,
        HKV=kv_heads,
        BLOCKS_PER_SPLIT=per_split,
        NS=n_splits,
        BLOCK=BLOCK_N,
        num_warps=PARTIAL_WARPS,
    )
    out = torch.empty((heads, dim), dtype=q.dtype, device=q.device)
    _attention_combine[(kv_heads,)](
        q,
        tables.rotation,
        tables.boundaries,
        k_new.reshape(kv_heads, dim).contiguous(),
        v_new.reshape(kv_heads, dim).contiguous(),
        codes,
        codes.view(torch.float32),
        position,
        workspace.m,
        workspace.l_sum,
        workspace.acc,
        out,
        slots,
        scale,
        softcap,
        **shape,
        **common,
        HKV=kv_heads,
        NS=n_splits,
        # 8 warps: at Triton's default 4 this program spills registers and took 55 µs on an
        # H200 instead of 6.5 (docs/PERFORMANCE.md)
        num_warps=COMBINE_WARPS,
    )
    return out.view(heads, 1, dim)


def encode(x: torch.Tensor, tables: CodecTables) -> torch.Tensor:
    """x: [N, D] → uint8 [N, bytes_per_vector], `TurboQuantCodec.encode`'s layout."""
    n, dim = x.shape
    codes = torch.empty((n, tables.bytes_per_vector), dtype=torch.uint8, device=x.device)
    _encode[(n,)](
        x.contiguous(),
        tables.rotation,
        tables.boundaries,
        codes,
        codes.view(torch.float32),
        D=dim,
        DP=tables.rotated_dim,
        BITS=tables.bits,
        BPV=tables.bytes_per_vector,
    )
    return codes
