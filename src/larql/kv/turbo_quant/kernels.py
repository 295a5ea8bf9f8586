"""turbo-quant's decode step on CUDA in three launches per layer: the queries rotated, attention
straight from the packed codes beside the exact rows', and the new row encoded into the store by
the launch that merges the attention.

The torch path decodes every stored row into a temporary ([n, D'] per head, ~10 launches), rotates
q and the new row, attends, rotates back and encodes the new row (~25 more launches: norm,
rotation, bucketize, bit packing, norm bytes). On a GPU at batch 1 those launches are the cost, not
the bytes. Here:

- `_rotate_queries`: one program per K/V head, its group's queries rotated (q·R) once for every
  split below.
- `_attention_partial`: one program per (K/V head, split of the stored rows), and one more for
  the exact rows. A split unpacks each row's indices from the bit stream, looks up the
  centroids, scales the scores and weights by the rows' norms and runs the online softmax in the
  rotated basis (where q·x = (q·R)·(x·R) since R is orthogonal and symmetric): products in
  the query's dtype, the softmax state in float32. The exact rows' program attends the layer's
  sink and newest rows (kept at 16 bits or int8) and the new row in the model's basis, beside
  the splits (in the combine launch they held up the merge: on an H200 one layer at depth
  32,000 went from 33.1 to 25.2 µs with this and the launch above).
- `_attention_combine`: two programs per K/V head, run at once. The first merges the splits'
  states, rotates them back (·R) and adds the exact rows' state, → [Hq, D] in the model's
  dtype. The second encodes the row that leaves the exact ones — the oldest recent row, or the
  new row itself when none are kept — (minus the layer's mean row with centering; norm, x/‖x‖·R,
  bucketize against the codebook boundaries, LSB-first bit packing, the float32 norm — with
  norm correction ‖x‖/‖ũ‖ — in front: `TurboQuantCodec.encode`'s bytes) into the store, and
  writes the new row among the exact ones: into a ring slot whose row is already coded (the
  ring has one slot more than the recent rows), so neither program waits for the other (on an
  H200 the combine went from 11.3 to 8.9 µs a layer at depth 32,000).
- `_encode`: the same encoding for many vectors at once (a prompt's K/V), one program each.

The step's launches serve B sessions at once (`batched_attention`; `attention` is B = 1 over one
session's own tensors): a program per (K/V head, split or role, session), session b's state
reached from the launch's base pointers (`Operands`) by the offsets in row b of its `meta`, with
its own position and store size. One captured graph then serves any set of sessions — their
offsets change, not the addresses the graph was captured with.

The levers (`Levers`, per layer) are the torch path's `QuantisedLayer` layout: token t < sinks
is exact in slot t of the exact rows; the newest `recent` tokens before the query are exact in
slot sinks + t mod ring_slots(recent); the tokens between are codes. With centering the codes
hold x − μ: a code row's score gets q·μ_K added (a constant over the codes), and the codes'
weighted values get μ_V times their weight.

The store is a fixed-capacity uint8 [slots, row_bytes] buffer per layer (the engine's
`CodeSlots`): token t lives in slot t mod slots, a stored token is 2·Hkv vectors [K head 0 …
K head Hkv−1, V head 0 … V head Hkv−1], each a float32 norm and its packed indices, laid out by
plane (`planes`): codes [2·Hkv, slots, payload], then norms [2·Hkv, slots]. The step reads its
position from a device tensor: the min(position, slots) filled slots are the history, slot
position mod slots receives the new row. Every shape and address is fixed, so the step can be
captured in a CUDA graph. A layer with slots ≥ every position holds all rows; a sliding layer
with slots = window − 1 is a ring of the rows a later query can still see.

A coordinate within float32 rounding of a codebook boundary may land in the neighbouring cell:
the kernels sum the rotation in a different order than torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from larql.kernels.dependent_launch import options as dependent_options
from larql.kernels.dependent_launch import wait_for_previous
from larql.kernels.online_softmax import (
    block_update,
    merge_splits,
    soft_capped,
    splits_max,
    store_split,
)
from larql.kv.turbo_quant import cuda_partial
from larql.kv.turbo_quant.codebook import codebook
from larql.kv.turbo_quant.codec import NORM_BYTES, TurboQuantCodec
from larql.kv.turbo_quant.layout import ring_slots
from larql.kv.turbo_quant.rotation import rotation_matrix

BLOCK_N = 128  # stored rows per block
STAGES = 3  # the block loop's software pipeline depth
# A launch has `splits(slots)` programs per K/V head, each over BLOCKS_PER_SPLIT blocks, a power
# of two ≥ the slots need: both compile-time constants (the block loop is not unrolled, so a deep
# store compiles as fast as a shallow one); blocks past the coded rows are skipped at run time.
# Deep stores get more programs: at 32,000 rows 32 per head, each walking 8 blocks of 128 rows
# (on an H200 16 or 64 per head, or blocks of 32 or 64 rows, were slower).
# In Triton's interpreter (a CPU machine's tests) every program runs in Python: a shallow store
# gets 2 splits there, not 16 (one still empty, so an empty split's merge still runs).
MIN_SPLITS = 2 if os.environ.get("TRITON_INTERPRET") == "1" else 16
MAX_SPLITS = 64
_BLOCKS_PER_PROGRAM = 8  # the split count aims at this many blocks per program
BATCH_PROGRAMS = 1024  # a batched launch's programs, about (`batch_splits`)
COMBINE_WARPS = 8
PARTIAL_WARPS = 4
_MIN_DOT = 16  # tl.dot needs every dimension ≥ 16
# ... except the query rows (a product's first dimension) on Triton ≥ 3.6, where 8 compile and
# the softmax then runs over 8 rows, not 16 (a 4-query group: one layer at depth 32,000 on an
# H200 35.1 → 33.0 µs; docs/PERFORMANCE.md)
_MIN_QUERY_ROWS = 8 if tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 6) else 16
# Exact rows the exact rows' program holds at once: 160 int8 recent rows in one [256, D'] block
# spilled registers and cost ~130 µs a layer on an H200 (docs/PERFORMANCE.md). The program runs
# in the partial launch and sets its registers with the splits' (the larger branch wins): chunks
# of 16 keep the launch at 128 registers a thread, 4 programs an SM (chunks of 32: 216)
EXACT_CHUNK = 16
LOOKUP_PACK = 8  # packed bytes one `centroid_lookup` instance decodes
CONSTRAINTS = tl.constexpr(",".join(["=r"] * LOOKUP_PACK + ["r"] * (LOOKUP_PACK // 4)))
PACK = tl.constexpr(LOOKUP_PACK)
NORM = tl.constexpr(NORM_BYTES)  # a kernel reads module globals only as constexprs
ZERO_NORM = tl.constexpr(1e-12)  # the codec's: a smaller norm encodes the zero vector
# A launch attends for B sessions: row b of its `meta` [B, META] int64 says where session b's
# state starts, in elements from each base pointer the launch is given (`Operands`), and how
# many slots its store has
AT_CODES, AT_EXACT, AT_RING, AT_RING_SCALES, AT_MEAN, AT_MEAN_ROTATED, AT_SLOTS = (
    tl.constexpr(column) for column in range(7)
)
META = tl.constexpr(7)
CODES_ALIGNMENT = 16  # bytes: a session's store starts this aligned from the codes base


def supports(codec: object) -> bool:
    """The kernels take a `TurboQuantCodec` of a head width tl.dot takes (D' ≥ 16) and vectors
    whose float32 norms stay 4-byte aligned in the store."""
    if not isinstance(codec, TurboQuantCodec):
        return False
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
    norm_correction: bool = False
    # 4-bit codes on CUDA: `centroid_lookup`'s PTX per 16-bit dtype (else none: tl.gather)
    lookups: dict[torch.dtype, str] = field(default_factory=dict)
    header_bytes: int = NORM_BYTES  # a vector's bytes before its codes in the store (`planes`)

    @staticmethod
    def of(codec: TurboQuantCodec, device: torch.device) -> CodecTables:
        book = codebook(codec.rotated_dim, codec.bits, device)
        lookups = {}
        if codec.bits == 4 and device.type == "cuda" and not interpreted():
            lookups = {dt: centroid_lookup(book.centroids, dt) for dt in LOOKUP_DTYPES}
        return CodecTables(
            lookups=lookups,
            dim=codec.dim,
            rotated_dim=codec.rotated_dim,
            bits=codec.bits,
            bytes_per_vector=codec.bytes_per_vector,
            rotation=rotation_matrix(codec.rotated_dim, torch.float32, device).contiguous(),
            centroids=book.centroids.contiguous(),
            boundaries=book.boundaries.contiguous(),
            norm_correction=codec.norm_correction,
        )


LOOKUP_DTYPES = (torch.bfloat16, torch.float16)


def interpreted() -> bool:
    """Triton's interpreter runs the kernels (it runs no inline PTX)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


FULL_LAYER_KEEP = 2**31 - 1  # `keep` of a layer that sees every earlier row


@dataclass(frozen=True)
class Levers:
    """One layer's exact rows and centering, as the kernels read them."""

    # [max(1, sinks + ring_slots(recent)), 2, Hkv, D] 16-bit, contiguous (with `ring`:
    # [max(1, sinks), …])
    exact: torch.Tensor
    mean: torch.Tensor  # [2, Hkv, D] float32: the mean K and V rows (zeros: no centering)
    mean_rotated: torch.Tensor  # [2, Hkv, D'] float32: mean · R
    sinks: int = 0
    recent: int = 0
    keep: int = FULL_LAYER_KEEP  # rows before its own a query sees
    center: bool = False
    # the recent rows at int8: codes [ring_slots(recent), 2, Hkv, D] int8 and scales
    # [ring_slots(recent), 2, Hkv] float16 (None: the recent rows are exact, in `exact` after
    # the sinks)
    ring: torch.Tensor | None = None
    ring_scales: torch.Tensor | None = None

    @staticmethod
    def none(kv_heads: int, tables: CodecTables, device: torch.device) -> Levers:
        """Every row coded, nothing centered, every earlier row seen."""
        f32 = {"dtype": torch.float32, "device": device}
        return Levers(
            exact=torch.zeros((1, 2, kv_heads, tables.dim), dtype=torch.float16, device=device),
            mean=torch.zeros((2, kv_heads, tables.dim), **f32),
            mean_rotated=torch.zeros((2, kv_heads, tables.rotated_dim), **f32),
        )

    def constants(self) -> dict[str, int | bool]:
        exact_rows = self.sinks + (ring_slots(self.recent) if self.recent else 0)
        return {
            "SINKS": self.sinks,
            "RECENT": self.recent,
            "RING": ring_slots(self.recent),
            "EP": -(-exact_rows // EXACT_CHUNK) * EXACT_CHUNK,  # whole chunks
            "EC": EXACT_CHUNK,
            "CENTER": self.center,
            "RING8": self.ring is not None,
        }


@dataclass(frozen=True)
class Workspace:
    """The launches' scratch, reused by every layer (they run in stream order): the rotated
    queries [B, Hq, D'] and the partial softmax states m, l [B·Hkv, MAX_SPLITS + 1, GP],
    acc [B·Hkv, MAX_SPLITS + 1, GP, D'] float32 for launches of up to B sessions. A launch of NS
    splits uses the first NS + 1 states of each (sequence, K/V head) — the splits', then the
    exact rows' — packed at the front (`state_slots`)."""

    m: torch.Tensor
    l_sum: torch.Tensor
    acc: torch.Tensor
    queries: torch.Tensor

    @staticmethod
    def of(
        heads: int, kv_heads: int, tables: CodecTables, device: torch.device, sessions: int = 1
    ) -> Workspace:
        group = heads // kv_heads  # (EXACT_CHUNK: the most exact rows its program holds at once)
        gp = _group_rows(group, _combine_rows(group, tables.rotated_dim, EXACT_CHUNK))
        f32 = {"dtype": torch.float32, "device": device}
        m = torch.empty((sessions * kv_heads, MAX_SPLITS + 1, gp), **f32)
        acc = torch.empty((sessions * kv_heads, MAX_SPLITS + 1, gp, tables.rotated_dim), **f32)
        queries = torch.empty((sessions, heads, tables.rotated_dim), **f32)
        return Workspace(m=m, l_sum=torch.empty_like(m), acc=acc, queries=queries)


def state_slots(n_splits: int) -> int:
    """States a launch of `n_splits` splits keeps per (sequence, K/V head): one per split, and
    the exact rows' after them."""
    return n_splits + 1


@triton.jit
def _queries(q_ptr, head, rows, dims, G: tl.constexpr, D: tl.constexpr):
    """The G query heads sharing K/V head `head`: [GP, DP] float32 (padded rows and dims 0)."""
    return tl.load(
        q_ptr + (head * G + rows)[:, None] * D + dims[None, :],
        mask=(rows < G)[:, None] & (dims < D)[None, :],
        other=0.0,
    ).to(tl.float32)


@triton.jit
def _indices(codes_ptr, starts, present, dims, BITS: tl.constexpr, BPV: tl.constexpr):
    """The quantiser indices of the vectors whose packed indices begin at byte offsets
    `starts` [B] → [B, DP] int32 in the rotated basis (0 where not `present`). Widths that
    divide a byte: each vector's packed bytes loaded once, contiguously, and the indices of
    each position in a byte interleaved back into coordinate order; else one byte load per
    coordinate (a 3-bit index may straddle two bytes)."""
    if BITS == 8:
        return tl.load(
            codes_ptr + starts[:, None] + dims[None, :], mask=present[:, None], other=0
        ).to(tl.int32)
    if BITS == 2:  # byte j holds coordinates 4j .. 4j + 3, two bits each from the lowest
        lanes = tl.arange(0, dims.shape[0] // 4)
        packed = tl.load(
            codes_ptr + starts[:, None] + lanes[None, :], mask=present[:, None], other=0
        ).to(tl.int32)  # [B, DP/4]
        pairs = tl.join(
            tl.join(packed & 3, (packed >> 4) & 3), tl.join((packed >> 2) & 3, packed >> 6)
        )
        return tl.reshape(pairs, [starts.shape[0], dims.shape[0]])  # [j, b, a] → 4j + 2b + a
    bit = dims * BITS
    byte = bit // 8  # [DP]
    where = starts[:, None] + byte[None, :]  # [B, DP]
    low = tl.load(codes_ptr + where, mask=present[:, None], other=0).to(tl.int32)
    if 8 % BITS != 0:  # a 3-bit index may straddle two bytes
        spill = present[:, None] & ((byte + 1) < BPV - NORM)[None, :]
        low |= tl.load(codes_ptr + where + 1, mask=spill, other=0).to(tl.int32) << 8
    return (low >> (bit % 8)[None, :]) & ((1 << BITS) - 1)


@triton.jit
def _norms_at(slots, HKV: tl.constexpr, BPV: tl.constexpr):
    """Where a store of `slots` slots laid out by plane (`planes`) keeps its norms: plane 0's
    first, in float32s (every plane's codes come first; plane p's slot s is vector p·slots + s
    of both)."""
    return 2 * HKV * slots * ((BPV - NORM) // 4)


@triton.jit
def _nibbles(codes_ptr, starts, present, lanes):
    """4-bit indices of the vectors whose packed indices begin at byte offsets `starts` [B],
    each packed byte loaded once → (even, odd) [B, DP/2] int32: byte j holds coordinate 2j in
    its low nibble and 2j + 1 in its high one (0 where not `present`)."""
    packed = tl.load(
        codes_ptr + starts[:, None] + lanes[None, :], mask=present[:, None], other=0
    ).to(tl.int32)
    return packed & 15, packed >> 4


@triton.jit
def _nibble_centroids(
    codes_ptr, starts, present, lanes, table, DOT: tl.constexpr, LOOKUP: tl.constexpr
):
    """The centroids of 4-bit indices of the vectors whose packed indices begin at byte offsets
    `starts` [B]: (even, odd) [B, DP/2] in DOT's dtype, coordinates 2j and 2j + 1 (0 where not
    `present`).
    With LOOKUP (`centroid_lookup`'s PTX) each packed byte is decoded in registers by byte
    permutes against the table held as immediates; else the indices are split and looked
    up in `table` ([B, 16] float32) with `tl.gather`."""
    if LOOKUP != "":
        packed = tl.load(
            codes_ptr + starts[:, None] + lanes[None, :], mask=present[:, None], other=0
        )  # [B, DP/2] uint8
        even, odd = tl.inline_asm_elementwise(
            LOOKUP, CONSTRAINTS, [packed], dtype=(tl.int16, tl.int16), is_pure=True, pack=PACK
        )  # the 16-bit patterns
        return even.to(DOT, bitcast=True), odd.to(DOT, bitcast=True)
    even, odd = _nibbles(codes_ptr, starts, present, lanes)
    return tl.gather(table, even, 1).to(DOT), tl.gather(table, odd, 1).to(DOT)


@triton.jit
def _rotate_queries(
    q_ptr,  # [B, Hq, D] model dtype
    rot_ptr,  # [DP, DP] float32
    out_ptr,  # [B, Hq, DP] float32: q·R
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    HKV: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for a float32 model, else "tf32"
    PDL: tl.constexpr = False,  # launched with `dependent_launch.options`
):
    """The queries in the rotated basis, once per layer for every split of the partial launch:
    each of its programs rotating its own copy put a [GP, D'] · [D', D'] product and the
    rotation's load before its first block (on an H200 one layer at depth 32,000 32.9 → 30.1 µs
    with this launch, 4,096 rows 15.6 → 14.5)."""
    wait_for_previous(PDL)
    head = tl.program_id(0)
    seq = tl.program_id(1)
    rows = tl.arange(0, GP)
    dims = tl.arange(0, DP)
    q = _queries(q_ptr + seq * (HKV * G * D), head, rows, dims, G, D)  # [GP, DP]
    rotation = tl.load(rot_ptr + dims[:, None] * DP + dims[None, :])  # [DP, DP]
    rotated = tl.dot(q, rotation, input_precision=PRECISION)
    at = (seq * HKV * G + head * G + rows)[:, None] * DP + dims[None, :]
    tl.store(out_ptr + at, rotated, mask=(rows < G)[:, None])


@triton.jit
def _session_store(codes_ptr, norms_ptr, state, pos_ptr, seq):
    """A session's store (its codes and their float32 view), its slots and its new token's
    position, from its `meta` row `state`. The slots and position as 32-bit integers: 64-bit
    index arithmetic costs a division subroutine per slot (`launch_indices_fit`)."""
    codes_at = tl.multiple_of(tl.load(state + AT_CODES), 16)
    slots = tl.load(state + AT_SLOTS).to(tl.int32)
    pos = tl.load(pos_ptr + seq).to(tl.int32)
    return codes_ptr + codes_at, norms_ptr + codes_at // 4, slots, pos


@triton.jit
def _exact_state(
    q_ptr,
    k_new_ptr,
    v_new_ptr,
    exact_ptr,
    ring_ptr,
    ring_scale_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    stat,
    pos,
    keep,
    head,
    scale,
    softcap,
    G: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    HKV: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    RECENT: tl.constexpr,
    RING: tl.constexpr,
    EP: tl.constexpr,
    EC: tl.constexpr,
    RING8: tl.constexpr,
):
    """The softmax state of K/V head `head`'s R query rows over the exact rows — the new token's,
    the sinks and the recent rows, in the model's basis — stored at state `stat` (their
    weighted values are added after the splits' are rotated back, R·R = I)."""
    rows = tl.arange(0, R)
    dims = tl.arange(0, DP)
    within = dims < D
    q = _queries(q_ptr, head, rows, dims, G, D)  # [R, DP]
    k_new = tl.load(k_new_ptr + head * D + dims, mask=within, other=0.0).to(tl.float32)
    v_new = tl.load(v_new_ptr + head * D + dims, mask=within, other=0.0).to(tl.float32)
    m_i = soft_capped(tl.sum(q * k_new[None, :], axis=1) * scale, softcap, SOFTCAP)  # [R]
    l_i = tl.full([R], 1.0, tl.float32)  # the new row's weight, exp(m_i − m_i)
    acc = tl.zeros([R, DP], tl.float32) + v_new[None, :]
    for c in tl.static_range(EP // EC):
        e = c * EC + tl.arange(0, EC)
        scores = _exact_scores(
            q,
            exact_ptr,
            ring_ptr,
            ring_scale_ptr,
            e,
            pos,
            keep,
            head,
            dims,
            within,
            scale,
            softcap,
            SOFTCAP,
            HKV,
            D,
            SINKS,
            RECENT,
            RING,
            RING8,
            R,
        )  # [R, EC], −inf where absent
        values, _ = _exact_chunk(
            exact_ptr,
            ring_ptr,
            ring_scale_ptr,
            e,
            pos,
            keep,
            head,
            dims,
            within,
            1,
            HKV,
            D,
            SINKS,
            RECENT,
            RING,
            RING8,
        )  # [EC, DP]
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: the new row is always seen
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])  # 0 where absent
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _product(p, values, R)
        m_i = m_new
    at = stat + rows
    tl.store(m_ptr + at, m_i)
    tl.store(l_ptr + at, l_i)
    tl.store(acc_ptr + at[:, None] * DP + dims[None, :], acc)


@triton.jit
def _split_state(
    q_ptr,
    q_rot_ptr,
    codes_ptr,
    norms_ptr,
    centroids_ptr,
    mean_rot_ptr,
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
    DP: tl.constexpr,
    HKV: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr,
    BPV: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    RECENT: tl.constexpr,
    CENTER: tl.constexpr,
    WRAPS: tl.constexpr,
    NIBBLES: tl.constexpr,
    LOOKUP: tl.constexpr,
):
    """Split `split`'s softmax state over its coded rows of K/V head `head` (q_rot_ptr: its
    group's rotated queries; mean_rot_ptr: the session's), stored at state `stat_slot`."""
    rows = tl.arange(0, GP)
    dims = tl.arange(0, DP)
    lanes = tl.arange(0, DP // 2)
    end_coded = tl.maximum(pos - RECENT, 0)  # the codes are tokens [first_coded, end_coded)
    first_coded = tl.maximum(pos - keep, SINKS)
    filled = tl.minimum(end_coded, slots)  # slots written so far
    payload: tl.constexpr = BPV - NORM  # code bytes a vector
    key_plane = head * slots  # the key's plane's first vector (`planes`), the value's HKV later
    norms_at = _norms_at(slots, HKV, BPV)
    split_first = split * BLOCKS_PER_SPLIT * BLOCK
    blocks = tl.minimum(tl.maximum(filled - split_first + BLOCK - 1, 0) // BLOCK, BLOCKS_PER_SPLIT)
    real = (rows < G)[:, None]
    if blocks == 0:
        # no coded row in this split (a short context, or a capacity not yet filled): the empty
        # state, without loading the queries (on an H200 the step at a short context ~6% faster)
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
            q_even = tl.load(
                q_rot_ptr + rows[:, None] * DP + (2 * lanes)[None, :], mask=real, other=0.0
            )  # [GP, DP/2]
            q_odd = tl.load(
                q_rot_ptr + rows[:, None] * DP + (2 * lanes + 1)[None, :], mask=real, other=0.0
            )
            sixteen = tl.arange(0, 16)[None, :] + tl.zeros([BLOCK, 1], tl.int32)  # [BLOCK, 16]
            table = tl.load(centroids_ptr + sixteen)
            shift = tl.zeros([GP], tl.float32)  # q·μ_K: what centering took off each code's score
            if CENTER:
                mean_even = tl.load(mean_rot_ptr + head * DP + 2 * lanes)
                mean_odd = tl.load(mean_rot_ptr + head * DP + 2 * lanes + 1)
                shift = tl.sum(q_even * mean_even[None, :], 1)
                shift += tl.sum(q_odd * mean_odd[None, :], 1)
                shift *= scale
            q_even = q_even.to(dot_dtype)
            q_odd = q_odd.to(dot_dtype)
            acc_even = tl.zeros([GP, DP // 2], tl.float32)
            acc_odd = tl.zeros([GP, DP // 2], tl.float32)
        else:
            q_rot = tl.load(q_rot_ptr + rows[:, None] * DP + dims[None, :], mask=real, other=0.0)
            shift = tl.zeros([GP], tl.float32)
            if CENTER:
                shift = tl.sum(q_rot * tl.load(mean_rot_ptr + head * DP + dims)[None, :], 1) * scale
            q_rot = q_rot.to(dot_dtype)
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
            read = slot >= 0  # every code byte is read (see above); the norms only where present
            key_norms = tl.load(norms_ptr + norms_at + vector, mask=present, other=0.0)  # [B]
            value_norms = tl.load(
                norms_ptr + norms_at + HKV * slots + vector, mask=present, other=0.0
            )
            if NIBBLES:
                even, odd = _nibble_centroids(
                    codes_ptr, key_starts, read, lanes, table, dot_dtype, LOOKUP
                )  # [B, DP/2] each
                s = tl.dot(q_even, tl.trans(even), input_precision="ieee")
                s += tl.dot(q_odd, tl.trans(odd), input_precision="ieee")
            else:
                index = _indices(codes_ptr, key_starts, read, dims, BITS, BPV)  # [B, DP]
                keys = tl.load(centroids_ptr + index).to(dot_dtype)
                s = tl.dot(q_rot, tl.trans(keys), input_precision="ieee")
            s = s * (key_norms * scale)[None, :] + shift[:, None]  # [GP, B]
            m_i, l_i, p, alpha = block_update(m_i, l_i, soft_capped(s, softcap, SOFTCAP), present)
            weights = (p * value_norms[None, :]).to(dot_dtype)
            if NIBBLES:
                even_values, odd_values = _nibble_centroids(
                    codes_ptr, value_starts, read, lanes, table, dot_dtype, LOOKUP
                )
                acc_even = acc_even * alpha[:, None] + tl.dot(
                    weights, even_values, input_precision="ieee"
                )
                acc_odd = acc_odd * alpha[:, None] + tl.dot(
                    weights, odd_values, input_precision="ieee"
                )
            else:
                index = _indices(codes_ptr, value_starts, read, dims, BITS, BPV)
                values = tl.load(centroids_ptr + index).to(dot_dtype)
                acc = acc * alpha[:, None] + tl.dot(weights, values, input_precision="ieee")
        if NIBBLES:  # the state holds the coordinates in order
            if CENTER:  # Σ p·(ṽ + μ_V) = acc + l·μ_V
                acc_even += l_i[:, None] * tl.load(mean_rot_ptr + (HKV + head) * DP + 2 * lanes)
                acc_odd += l_i[:, None] * tl.load(mean_rot_ptr + (HKV + head) * DP + 2 * lanes + 1)
            stat = stat_slot * GP + rows
            tl.store(m_ptr + stat, m_i)
            tl.store(l_ptr + stat, l_i)
            tl.store(acc_ptr + stat[:, None] * DP + (2 * lanes)[None, :], acc_even)
            tl.store(acc_ptr + stat[:, None] * DP + (2 * lanes + 1)[None, :], acc_odd)
        else:
            if CENTER:
                acc += l_i[:, None] * tl.load(mean_rot_ptr + (HKV + head) * DP + dims)[None, :]
            store_split(m_ptr, l_ptr, acc_ptr, stat_slot, rows, dims, m_i, l_i, acc, DP)


@triton.jit
def _attention_partial(
    q_ptr,  # [B, Hq, D] model dtype
    q_rot_ptr,  # [B, Hq, DP] float32: q·R (`_rotate_queries`)
    k_new_ptr,  # [B, Hkv, D] the new token's exact key
    v_new_ptr,  # [B, Hkv, D]
    codes_ptr,  # uint8 [slots, row_bytes], the store (by plane: `planes`)
    norms_ptr,  # float32 view of the same bytes
    exact_ptr,  # [E, 2, Hkv, D] 16-bit: sinks, then the ring of recent rows (RING8: sinks only)
    ring_ptr,  # RING8: int8 [RING, 2, Hkv, D], the ring of recent rows
    ring_scale_ptr,  # RING8: float16 [RING, 2, Hkv], their scales
    centroids_ptr,  # [2^BITS] float32
    mean_rot_ptr,  # [2, HKV, DP] float32: the layer's mean K and V rows, rotated
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
    R: tl.constexpr,  # the exact rows' program's query rows (`_combine_rows`)
    D: tl.constexpr,
    DP: tl.constexpr,
    HKV: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr,
    NS: tl.constexpr,
    BPV: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    RECENT: tl.constexpr,
    RING: tl.constexpr,  # ring_slots(RECENT)
    EP: tl.constexpr,
    EC: tl.constexpr,  # exact rows per chunk
    CENTER: tl.constexpr,
    RING8: tl.constexpr,  # the recent rows at int8 with a float16 scale per head vector
    WRAPS: tl.constexpr,  # a sliding layer's ring of slots (a full layer's slot t is token t)
    NIBBLES: tl.constexpr,  # 4-bit codes and D' ≥ 32: read as bytes, split even / odd
    LOOKUP: tl.constexpr = "",  # NIBBLES: `centroid_lookup`'s PTX ("": tl.gather)
    PDL: tl.constexpr = False,  # launched with `dependent_launch.options`
):
    """Programs 0 … NS − 1 of a (K/V head, session): a split's state over its coded rows; program
    NS: the exact rows' state (`_exact_state`), beside the splits rather than after them in the
    combine launch (on an H200 one layer at depth 32,000 −4.8 µs).

    A split scales the scores and the weights by the row norms (not the [B, D'] decoded rows);
    the products run in the query's dtype (16-bit: the tensor cores; float32: "ieee"). 4-bit codes
    are read as whole bytes and split into the even and odd coordinates (two products over D'/2
    each) with the codebook looked up in registers (`tl.gather`): on an H200 that took one
    layer's partial launch at depth 32,000 from 202 to 57 µs. In a 16-bit model on CUDA the
    lookup is byte permutes in PTX (`centroid_lookup`): no warp shuffles, and Triton then moves
    the packed bytes, not the decoded rows, into the matrix units' layout — the loop's
    instructions 1,868 → 1,075, the launch 36.7 → 25.9 µs. Other widths read one byte per
    coordinate. The codes are read unmasked from in-bounds slots (any byte decodes to a finite
    centroid, and an absent row weighs 0): the block's masks were an eighth of its
    instructions."""
    wait_for_previous(PDL)
    head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    pair = seq * HKV + head  # the workspace's (sequence, K/V head)
    first_state = pair * (NS + 1)  # its states: the NS splits', then the exact rows'
    state = meta_ptr + seq * META
    codes_ptr, norms_ptr, slots, pos = _session_store(codes_ptr, norms_ptr, state, pos_ptr, seq)
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
        _split_state(
            q_ptr,
            q_rot_ptr + (seq * HKV * G + head * G) * DP,
            codes_ptr,
            norms_ptr,
            centroids_ptr,
            mean_rot_ptr + tl.load(state + AT_MEAN_ROTATED),
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
            DP,
            HKV,
            BLOCKS_PER_SPLIT,
            BPV,
            BITS,
            BLOCK,
            STAGES,
            SOFTCAP,
            SINKS,
            RECENT,
            CENTER,
            WRAPS,
            NIBBLES,
            LOOKUP,
        )


@triton.jit
def _encoded(
    x,
    rotation,
    boundaries_ptr,
    centroids_ptr,
    dims,
    DP: tl.constexpr,
    BITS: tl.constexpr,
    NORM_FIX: tl.constexpr,
):
    """One vector x [DP] float32 (0 past D) → (the norm to store: ‖x‖, or ‖x‖/‖ũ‖ with
    NORM_FIX, ũ the quantised unit vector; its packed indices as words [DP / 8] uint32: word g
    holds indices 8g..8g+7, BITS bits each from the lowest, which are exactly bytes
    g·BITS .. g·BITS + BITS − 1 of the LSB-first stream)."""
    norm = tl.sqrt(tl.sum(x * x, axis=0))
    nonzero = norm > ZERO_NORM
    unit = tl.where(nonzero, x / tl.where(nonzero, norm, 1.0), 0.0)
    y = tl.sum(unit[:, None] * rotation, axis=0)  # [DP] = unit·R
    index = tl.zeros_like(dims)  # [DP] int32
    for t in tl.static_range((1 << BITS) - 1):
        index += (y >= tl.load(boundaries_ptr + t)).to(tl.int32)
    if NORM_FIX:
        centroids = tl.load(centroids_ptr + index)  # [DP] = ũ
        quantised = tl.sqrt(tl.sum(centroids * centroids, axis=0))
        norm = norm / tl.where(quantised > ZERO_NORM, quantised, 1.0)
    groups = tl.reshape(index.to(tl.uint32), [DP // 8, 8])
    shift = (tl.arange(0, 8) * BITS).to(tl.uint32)
    words = tl.sum(groups << shift[None, :], axis=1)  # disjoint bits: sum = or
    return norm, words


@triton.jit
def _store_encoded(
    codes_ptr,
    norms_ptr,
    start,
    norm_at,
    norm,
    words,
    write,
    DP: tl.constexpr,
    BITS: tl.constexpr,
):
    """A vector, where `write`: its packed indices from byte offset `start`, its norm at
    float32 `norm_at`."""
    group = tl.arange(0, DP // 8)
    writes = _spread(write, group)  # [DP / 8]
    for k in tl.static_range(BITS):
        byte = (words >> (8 * k)) & 0xFF
        tl.store(codes_ptr + start + group * BITS + k, byte.to(tl.uint8), mask=writes)
    tl.store(norms_ptr + norm_at + group * 0, norm + group * 0.0, mask=writes & (group == 0))


@triton.jit
def _spread(flag, like):
    """A scalar condition as a mask shaped like `like` (Triton's interpreter refuses a vector
    mask combined with a scalar one)."""
    return (like * 0 + flag.to(tl.int32)) > 0


@triton.jit
def _merged_output(
    rotation,
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    pair,
    head,
    rows,
    dims,
    within,
    G: tl.constexpr,
    GP: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    NS: tl.constexpr,
    ROTATED: tl.constexpr = True,
):
    """The attention of (sequence, K/V head) `pair` from its NS + 1 states → out_ptr [G, D]
    (the sequence's, model dtype). The splits' states are in the rotated basis, the exact rows'
    (state NS) in the model's: its weighted values are added after the rotation back
    (R·R = I). Without ROTATED (codes in the model's basis) the splits' are added as they are
    and `rotation` is not read."""
    first = pair * (NS + 1) * GP  # this head's states
    top = splits_max(
        m_ptr + first, 0, rows, tl.full([R], float("-inf"), tl.float32), NS + 1, GP
    )  # finite: the exact rows hold the new one
    total, rotated = merge_splits(
        m_ptr + first,
        l_ptr + first,
        acc_ptr + first * DP,
        0,
        rows,
        dims,
        top,
        tl.zeros([R], tl.float32),
        tl.zeros([R, DP], tl.float32),
        NS,
        DP,
        GP,
    )
    exact = first + NS * GP + rows
    weight = tl.exp(tl.load(m_ptr + exact) - top)
    total += weight * tl.load(l_ptr + exact)
    plain = weight[:, None] * tl.load(acc_ptr + exact[:, None] * DP + dims[None, :])
    # float32 products here: tf32 measured slower (10.1 → 14.0 µs at depth 32,000, H200)
    out = rotated
    if ROTATED:
        out = _product(rotated, rotation, R)  # back: ·R
    out = (out + plain) / total[:, None]
    offsets = (head * G + rows)[:, None] * D + dims[None, :]
    mask = (rows < G)[:, None] & within[None, :]
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rows_moved(
    rotation,
    boundaries_ptr,
    centroids_ptr,
    k_new_ptr,
    v_new_ptr,
    codes_ptr,
    norms_ptr,
    exact_ptr,
    ring_ptr,
    ring_scale_ptr,
    mean_ptr,
    slots,
    pos,
    head,
    dims,
    within,
    D: tl.constexpr,
    DP: tl.constexpr,
    HKV: tl.constexpr,
    BPV: tl.constexpr,
    BITS: tl.constexpr,
    SINKS: tl.constexpr,
    RECENT: tl.constexpr,
    RING: tl.constexpr,
    EP: tl.constexpr,
    CENTER: tl.constexpr,
    NORM_FIX: tl.constexpr,
    RING8: tl.constexpr,
):
    """K/V head `head`'s rows moving between the parts of a session's state: the row that
    leaves the exact ones (the oldest recent row, or the new row itself when none are kept)
    encoded into its slot, and the new row written among the exact ones."""
    k_new = tl.load(k_new_ptr + head * D + dims, mask=within, other=0.0).to(tl.float32)
    v_new = tl.load(v_new_ptr + head * D + dims, mask=within, other=0.0).to(tl.float32)
    token, key, value = _leaving_row(
        k_new,
        v_new,
        exact_ptr,
        ring_ptr,
        ring_scale_ptr,
        mean_ptr,
        pos,
        head,
        dims,
        within,
        D,
        HKV,
        SINKS,
        RECENT,
        RING,
        CENTER,
        RING8,
    )
    write = (token >= SINKS) & (token >= 0)  # a scalar
    payload: tl.constexpr = BPV - NORM
    k_at = head * slots + tl.maximum(token, 0) % slots  # the key's vector in the planes
    v_at = k_at + HKV * slots  # (`planes`)
    norms_at = _norms_at(slots, HKV, BPV)
    k_norm, k_words = _encoded(
        key, rotation, boundaries_ptr, centroids_ptr, dims, DP, BITS, NORM_FIX
    )
    v_norm, v_words = _encoded(
        value, rotation, boundaries_ptr, centroids_ptr, dims, DP, BITS, NORM_FIX
    )
    _store_encoded(
        codes_ptr, norms_ptr, k_at * payload, norms_at + k_at, k_norm, k_words, write, DP, BITS
    )
    _store_encoded(
        codes_ptr, norms_ptr, v_at * payload, norms_at + v_at, v_norm, v_words, write, DP, BITS
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


@triton.jit
def _leaving_row(
    k_new,
    v_new,
    exact_ptr,
    ring_ptr,
    ring_scale_ptr,
    mean_ptr,
    pos,
    head,
    dims,
    within,
    D: tl.constexpr,
    HKV: tl.constexpr,
    SINKS: tl.constexpr,
    RECENT: tl.constexpr,
    RING: tl.constexpr,
    CENTER: tl.constexpr,
    RING8: tl.constexpr,
):
    """The row of K/V head `head` that leaves the exact ones at position `pos` — the oldest
    recent row, or the new row k_new, v_new [DP] float32 itself when none are kept — → (its
    token, its key and value [DP] float32, minus the layer's mean with CENTER). It is coded
    where token ≥ max(SINKS, 0)."""
    exact_stride = 2 * HKV * D  # elements per token in the exact rows
    if RECENT == 0:
        token = pos
        key, value = k_new, v_new
    else:
        token = pos - RECENT
        leaving = within & _spread(token >= 0, dims)
        if RING8:
            slot_out = tl.maximum(token, 0) % RING
            source = ring_ptr + slot_out * exact_stride + head * D
            k_out_scale = tl.load(ring_scale_ptr + slot_out * 2 * HKV + head).to(tl.float32)
            v_out_scale = tl.load(ring_scale_ptr + slot_out * 2 * HKV + HKV + head)
            key = tl.load(source + dims, mask=leaving, other=0).to(tl.float32) * k_out_scale
            value = tl.load(source + HKV * D + dims, mask=leaving, other=0).to(tl.float32)
            value *= v_out_scale.to(tl.float32)
        else:
            source = exact_ptr + (SINKS + tl.maximum(token, 0) % RING) * exact_stride + head * D
            key = tl.load(source + dims, mask=leaving, other=0.0).to(tl.float32)
            value = tl.load(source + HKV * D + dims, mask=leaving, other=0.0).to(tl.float32)
    if CENTER:
        key -= tl.load(mean_ptr + head * D + dims, mask=within, other=0.0)
        value -= tl.load(mean_ptr + (HKV + head) * D + dims, mask=within, other=0.0)
    return token, key, value


@triton.jit
def _row_into_exact(
    k_new,
    v_new,
    exact_ptr,
    ring_ptr,
    ring_scale_ptr,
    pos,
    head,
    dims,
    within,
    D: tl.constexpr,
    HKV: tl.constexpr,
    SINKS: tl.constexpr,
    RECENT: tl.constexpr,
    RING: tl.constexpr,
    EP: tl.constexpr,
    RING8: tl.constexpr,
):
    """The new row k_new, v_new [DP] float32 of K/V head `head` among the exact ones: a sink,
    or the ring slot of a row already coded (at int8 with RING8)."""
    exact_stride = 2 * HKV * D  # elements per token in the exact rows
    if EP > 0:
        if RING8:  # a sink at 16 bits, else into the ring at int8
            sink = within & _spread(pos < SINKS, dims)
            sink_slot = tl.where(pos < SINKS, pos, 0)
            target = exact_ptr + sink_slot * exact_stride + head * D + dims
            tl.store(target, k_new.to(exact_ptr.dtype.element_ty), mask=sink)
            tl.store(target + HKV * D, v_new.to(exact_ptr.dtype.element_ty), mask=sink)
            into_ring = pos >= SINKS
            slot_in = pos % RING
            target = ring_ptr + slot_in * exact_stride + head * D + dims
            kept = within & _spread(into_ring, dims)
            k_codes, k_scale16 = _int8_row(k_new, within)
            v_codes, v_scale16 = _int8_row(v_new, within)
            tl.store(target, k_codes, mask=kept)
            tl.store(target + HKV * D, v_codes, mask=kept)
            tl.store(ring_scale_ptr + slot_in * 2 * HKV + head, k_scale16, mask=into_ring)
            tl.store(ring_scale_ptr + slot_in * 2 * HKV + HKV + head, v_scale16, mask=into_ring)
        else:
            into = tl.where(pos < SINKS, pos, SINKS + pos % RING)
            kept = within & _spread((pos < SINKS) | (RECENT > 0), dims)
            target = exact_ptr + into * exact_stride + head * D + dims
            tl.store(target, k_new.to(exact_ptr.dtype.element_ty), mask=kept)
            tl.store(target + HKV * D, v_new.to(exact_ptr.dtype.element_ty), mask=kept)


@triton.jit
def _attention_combine(
    rot_ptr,  # [DP, DP] float32
    boundaries_ptr,  # [2^BITS − 1] float32
    centroids_ptr,  # [2^BITS] float32
    k_new_ptr,  # [Hkv, D] the new token's exact key
    v_new_ptr,  # [Hkv, D]
    codes_ptr,  # uint8 [slots, row_bytes], the store (by plane): the leaving row goes here
    norms_ptr,  # float32 view of the same bytes
    exact_ptr,  # [E, 2, Hkv, D] 16-bit: sinks, then the ring of recent rows (RING8: sinks only)
    ring_ptr,  # RING8: int8 [RING, 2, Hkv, D], the ring of recent rows
    ring_scale_ptr,  # RING8: float16 [RING, 2, Hkv], their scales
    mean_ptr,  # [2, Hkv, D] float32
    meta_ptr,  # [B, META] int64: each session's offsets from the pointers above, its slots
    pos_ptr,  # [B] int64
    m_ptr,  # the partial launch's states: [B·Hkv, NS + 1, GP(, DP)] float32
    l_ptr,
    acc_ptr,
    out_ptr,  # [B, Hq, D] model dtype
    G: tl.constexpr,
    GP: tl.constexpr,
    R: tl.constexpr,  # the query rows held: G rounded up to a power of two, or GP (`_combine_rows`)
    D: tl.constexpr,
    DP: tl.constexpr,
    HKV: tl.constexpr,
    NS: tl.constexpr,
    BPV: tl.constexpr,
    BITS: tl.constexpr,
    SINKS: tl.constexpr,
    RECENT: tl.constexpr,
    RING: tl.constexpr,  # ring_slots(RECENT)
    EP: tl.constexpr,
    CENTER: tl.constexpr,
    NORM_FIX: tl.constexpr,
    RING8: tl.constexpr,  # the recent rows at int8 with a float16 scale per head vector
    PDL: tl.constexpr = False,  # launched with `dependent_launch.options`
):
    wait_for_previous(PDL)
    head = tl.program_id(0)
    role = tl.program_id(1)  # 0: the attention; 1: the rows moving between the parts
    seq = tl.program_id(2)
    pair = seq * HKV + head  # the workspace's (sequence, K/V head)
    state = meta_ptr + seq * META
    codes_ptr, norms_ptr, slots, pos = _session_store(codes_ptr, norms_ptr, state, pos_ptr, seq)
    exact_ptr += tl.load(state + AT_EXACT)
    ring_ptr += tl.load(state + AT_RING)
    ring_scale_ptr += tl.load(state + AT_RING_SCALES)
    mean_ptr += tl.load(state + AT_MEAN)
    out_ptr += seq * (HKV * G * D)
    k_new_ptr += seq * (HKV * D)
    v_new_ptr += seq * (HKV * D)
    rows = tl.arange(0, R)
    dims = tl.arange(0, DP)
    within = dims < D
    rotation = tl.load(rot_ptr + dims[:, None] * DP + dims[None, :])  # [DP, DP]
    if role == 0:
        _merged_output(
            rotation,
            m_ptr,
            l_ptr,
            acc_ptr,
            out_ptr,
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
        )
    else:
        _rows_moved(
            rotation,
            boundaries_ptr,
            centroids_ptr,
            k_new_ptr,
            v_new_ptr,
            codes_ptr,
            norms_ptr,
            exact_ptr,
            ring_ptr,
            ring_scale_ptr,
            mean_ptr,
            slots,
            pos,
            head,
            dims,
            within,
            D,
            DP,
            HKV,
            BPV,
            BITS,
            SINKS,
            RECENT,
            RING,
            EP,
            CENTER,
            NORM_FIX,
            RING8,
        )


@triton.jit
def _exact_scores(
    q,
    exact_ptr,
    ring_ptr,
    ring_scale_ptr,
    e,
    pos,
    keep,
    head,
    dims,
    within,
    scale,
    softcap,
    SOFTCAP: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    SINKS: tl.constexpr,
    RECENT: tl.constexpr,
    RING: tl.constexpr,
    RING8: tl.constexpr,
    R: tl.constexpr,
):
    """The queries' scores [R, EC] against exact rows e, soft-capped; −inf where absent."""
    keys, present = _exact_chunk(
        exact_ptr,
        ring_ptr,
        ring_scale_ptr,
        e,
        pos,
        keep,
        head,
        dims,
        within,
        0,
        HKV,
        D,
        SINKS,
        RECENT,
        RING,
        RING8,
    )
    scores = _product(q, tl.trans(keys), R) * scale
    scores = soft_capped(scores, softcap, SOFTCAP)
    return tl.where(present[None, :], scores, float("-inf"))


@triton.jit
def _product(a, b, R: tl.constexpr):
    """a [R, K] · b [K, N] in float32: a matrix-unit product ("ieee") where R ≥ 16, which
    it needs; else multiplied and summed, so the few real query rows are not padded to 16."""
    if R >= 16:  # tl.dot needs every dimension ≥ 16
        return tl.dot(a, b, input_precision="ieee")
    return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


@triton.jit
def _exact_chunk(
    exact_ptr,
    ring_ptr,
    ring_scale_ptr,
    e,
    pos,
    keep,
    head,
    dims,
    within,
    WHICH: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    SINKS: tl.constexpr,
    RECENT: tl.constexpr,
    RING: tl.constexpr,
    RING8: tl.constexpr,
):
    """Exact rows e (sink slots, then ring slots) of one K/V head at the query's position:
    the keys (WHICH 0) or values (1) [EC, DP] float32, 0 where absent, and which are
    present [EC] (a sink below the position; a ring slot whose latest token is recent, past
    the sinks and within the layer's span)."""
    ring = e - SINKS
    latest = ring + RING * ((pos - 1 - ring) // RING)  # the latest token in ring slot `ring`
    present = tl.where(
        e < SINKS,
        e < pos,
        (ring >= 0)
        & (ring < RING)
        & (ring <= pos - 1)
        & (latest >= pos - RECENT)
        & (latest >= SINKS)
        & (latest >= pos - keep),
    )
    stride = 2 * HKV * D
    loaded = present[:, None] & within[None, :]
    where = e[:, None] * stride + WHICH * HKV * D + head * D + dims[None, :]
    if RING8:  # sinks from the 16-bit rows, the ring's rows decoded from int8
        slot = tl.maximum(ring, 0)
        from_ring = present & (e >= SINKS)
        ring_where = slot[:, None] * stride + WHICH * HKV * D + head * D + dims[None, :]
        scale_at = slot * 2 * HKV + WHICH * HKV + head
        scales = tl.load(ring_scale_ptr + scale_at, mask=from_ring, other=0.0).to(tl.float32)
        x = tl.load(exact_ptr + where, mask=loaded & (e < SINKS)[:, None], other=0.0)
        codes = tl.load(ring_ptr + ring_where, mask=loaded & from_ring[:, None], other=0)
        return x.to(tl.float32) + codes.to(tl.float32) * scales[:, None], present
    return tl.load(exact_ptr + where, mask=loaded, other=0.0).to(tl.float32), present


@triton.jit
def _int8_row(x, within):
    """x [DP] float32 → (int8 codes [DP], float16 scale): `recent.int8_encode`'s arithmetic —
    scale = largest |x| / 127 rounded to float16, codes = x / scale (IEEE division) rounded half
    to even, within ±127."""
    largest = tl.max(tl.where(within, tl.abs(x), 0.0), axis=0)
    scale16 = tl.math.div_rn(largest, 127.0).to(tl.float16)
    divisor = tl.where(scale16 > 0, scale16.to(tl.float32), 1.0)
    ratio = tl.math.div_rn(x, divisor + x * 0.0)
    nearest = tl.floor(ratio + 0.5)
    odd = (nearest - 2.0 * tl.floor(nearest * 0.5)) != 0.0
    nearest = tl.where((nearest - ratio == 0.5) & odd, nearest - 1.0, nearest)  # ties to even
    return tl.minimum(tl.maximum(nearest, -127.0), 127.0).to(tl.int8), scale16


@triton.jit
def _encode(
    x_ptr,  # [N, D] model dtype
    rot_ptr,  # [DP, DP] float32
    boundaries_ptr,  # [2^BITS − 1] float32
    centroids_ptr,  # [2^BITS] float32
    mean_ptr,  # [M, D] float32: vector i is centered on mean row i mod M
    codes_ptr,  # uint8 [N · BPV]: the codec's row format (vector by vector)
    norms_ptr,  # float32 view of the same bytes
    M: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BITS: tl.constexpr,
    BPV: tl.constexpr,
    CENTER: tl.constexpr,
    NORM_FIX: tl.constexpr,
):
    vector = tl.program_id(0)
    dims = tl.arange(0, DP)
    x = tl.load(x_ptr + vector * D + dims, mask=dims < D, other=0.0).to(tl.float32)  # [DP]
    if CENTER:
        x -= tl.load(mean_ptr + (vector % M) * D + dims, mask=dims < D, other=0.0)
    rotation = tl.load(rot_ptr + dims[:, None] * DP + dims[None, :])  # [DP, DP]
    norm, words = _encoded(x, rotation, boundaries_ptr, centroids_ptr, dims, DP, BITS, NORM_FIX)
    _store_encoded(
        codes_ptr,
        norms_ptr,
        vector * BPV + NORM,
        vector * BPV // 4,
        norm,
        words,
        vector >= 0,
        DP,
        BITS,
    )


def centroid_lookup(centroids: torch.Tensor, dtype: torch.dtype, pack: int = LOOKUP_PACK) -> str:
    """PTX decoding packed bytes of 4-bit indices (low nibble: an even coordinate, high: the
    odd one) into 16-bit centroids, `pack` bytes per instance (`tl.inline_asm_elementwise`:
    inputs $P … the bytes, 4 per register; outputs $0 … $P/2 − 1 the even centroids and
    $P/2 … $P − 1 the odd ones, two per register).

    The codebook is symmetric (c[15 − i] = −c[i]), so index i ≥ 8 is +c[i] and i < 8 is
    −c[15 − i]: the magnitudes of entries 8–15, rounded to `dtype` (bfloat16 or float16) as the
    gather path rounds the centroids, are immediates — their low bytes in 2 words, their high
    bytes in 2 more. Per 8 indices: the magnitude selectors (i XOR 7 where i < 8, low 3 bits)
    from a few logic operations, one byte permute (prmt) per 4 low bytes and per 4 high
    bytes, the sign into the high bytes (a prmt in sign mode spreads each index's top bit
    into a byte mask), two permutes interleaving low and high bytes: 18 integer instructions,
    none touching shared memory (the `tl.gather` path shuffles across the warp per index)."""
    bits = centroids.to(dtype).view(torch.int16).to(torch.int32).bitwise_and(0xFFFF).tolist()
    assert len(bits) == 16 and pack % 4 == 0
    assert all(bits[15 - i] == bits[i] ^ 0x8000 for i in range(8)), "a symmetric codebook"
    magnitudes = bits[8:]

    def words(shift: int) -> list[int]:
        return [
            sum(((magnitudes[4 * w + i] >> shift) & 0xFF) << (8 * i) for i in range(4))
            for w in range(2)
        ]

    (l0, l1), (h0, h1) = words(0), words(8)
    body = [
        "{ .reg .b32 w, n, t, s1, s2, m1, m2, lo, hi; ",
        f".reg .b32 l0, h0; mov.b32 l0, {l0:#010x}; mov.b32 h0, {h0:#010x}; ",
    ]
    half_regs = pack // 2  # output registers per output
    for word in range(pack // 4):
        body.append(
            f"mov.b32 w, ${pack + word}; "
            "not.b32 n, w; and.b32 n, n, 0x88888888; "  # each nibble's bit 3: index < 8
            "shr.b32 t, n, 3; sub.u32 t, n, t; "  # 7 in each such nibble
            "xor.b32 s1, w, t; and.b32 s1, s1, 0x77777777; shr.b32 s2, s1, 16; "
            # nibble j's bit 3 → byte j of a mask: in n, bits 7, 15 …; shifted, bits 3, 11 …
            "shl.b32 t, n, 4; prmt.b32 m1, t, n, 0xD9C8; prmt.b32 m2, t, n, 0xFBEA; "
        )
        for k, (selector, mask) in enumerate((("s1", "m1"), ("s2", "m2"))):
            even, odd = f"${2 * word + k}", f"${half_regs + 2 * word + k}"
            body.append(
                f"prmt.b32 lo, l0, {l1:#010x}, {selector}; "
                f"prmt.b32 hi, h0, {h1:#010x}, {selector}; "
                f"and.b32 {mask}, {mask}, 0x80808080; xor.b32 hi, hi, {mask}; "
                f"prmt.b32 {even}, lo, hi, 0x6240; prmt.b32 {odd}, lo, hi, 0x7351; "
            )
    return "".join(body) + "}"


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def splits(slots: int) -> int:
    """Programs per K/V head for a store of `slots` slots: a power of two in
    [MIN_SPLITS, MAX_SPLITS], aiming at _BLOCKS_PER_PROGRAM blocks each."""
    wanted = _next_power_of_two(max(1, slots // (BLOCK_N * _BLOCKS_PER_PROGRAM)))
    return min(MAX_SPLITS, max(MIN_SPLITS, wanted))


def batch_splits(slots: int, pairs: int) -> int:
    """Programs per (sequence, K/V head) for a launch over `pairs` of them, stores of up to
    `slots` slots: `splits(slots)` for one session; fewer as sessions add programs, down to
    one, keeping about BATCH_PROGRAMS in all. The partial launch is bound by its instructions
    once the GPU is full, and every split costs the combine a merge: on an H200, 130 sessions
    at depth 32,000 (1B shape) took 2.53 ms a layer at 32 splits, 1.87 at 1 or 2."""
    wanted = _next_power_of_two(max(1, -(-BATCH_PROGRAMS // pairs)))
    return max(1, min(wanted, splits(slots)))


def precision(dtype: torch.dtype) -> str:
    """The precision of the query rotation (`_rotate_queries`: q·R, float32 operands): "ieee"
    for a float32 model; "tf32" (the tensor cores) for a 16-bit one, whose queries tf32 holds
    exactly (bf16 and fp16 keep at most 10 mantissa bits; the rotation's entries, all ±1/√D',
    round alike: a common scale within 2⁻¹¹) and whose rotated queries are rounded to 16 bits
    before their products. On an H200 that took the launch at depth 32,000 from 58.1 to 49.6 µs
    (when each split rotated its own copy)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_indices_fit(slots: int, row_bytes: int) -> bool:
    """The partial launch indexes a store with 32-bit integers: on an H200 the 64-bit
    index arithmetic (the position is an int64 tensor) compiled to a division subroutine per
    slot and made up a fifth of the loop's instructions."""
    return slots * row_bytes < 2**31


def _combine_rows(group: int, dp: int, exact_chunk: int) -> int:
    """Query rows the combine launch holds: the group rounded up to a power of two, whose
    products it multiplies and sums without the matrix units (on an H200 the padded float32
    products were most of its instructions) — unless the largest of them, [rows, D'] · [D',
    D'], would not fit in registers (wide heads): then the group padded for tl.dot."""
    rows = _next_power_of_two(group)
    return rows if rows * dp * max(dp, exact_chunk) <= 2**14 else max(_MIN_DOT, rows)


def _group_rows(group: int, combine_rows: int) -> int:
    """Query rows a partial-launch program holds: the group, padded for tl.dot, and no fewer
    than the combine launch reads back (`_combine_rows`)."""
    return max(_MIN_QUERY_ROWS, _next_power_of_two(group), combine_rows)


@dataclass(frozen=True)
class Operands:
    """The base tensors a launch's sessions find their state from (by the offsets in `meta`):
    one session's own tensors (offsets 0), or views of one anchor for a batch."""

    codes: torch.Tensor  # uint8: the store
    exact: torch.Tensor  # 16-bit: the exact sink and recent rows
    ring: torch.Tensor  # int8: the int8 recent rows (unread without them)
    ring_scales: torch.Tensor  # float16: their scales (unread without them)
    mean: torch.Tensor  # float32: the mean K and V rows
    mean_rotated: torch.Tensor  # float32: the same, rotated

    @staticmethod
    def of(codes: torch.Tensor, levers: Levers) -> Operands:
        """One session's own tensors."""
        ring = levers.exact if levers.ring is None else levers.ring
        scales = levers.exact if levers.ring_scales is None else levers.ring_scales
        return Operands(codes, levers.exact, ring, scales, levers.mean, levers.mean_rotated)

    @staticmethod
    def anchored(anchor: torch.Tensor, exact_dtype: torch.dtype) -> Operands:
        """Views of `anchor` (uint8, 16-byte aligned, ≥ 8 bytes) for every base: a batch's
        sessions are reached by their offsets from it (`session_meta`)."""
        f32 = anchor.view(torch.float32)
        return Operands(
            anchor,
            anchor.view(exact_dtype),
            anchor.view(torch.int8),
            anchor.view(torch.float16),
            f32,
            f32,
        )

    def offsets(self, codes: torch.Tensor, levers: Levers) -> list[int]:
        """A session's row of `meta`: its tensors' offsets from these bases, in elements (0 for
        the int8 ring it does not have), and its slots."""
        ring = [(self.ring, levers.ring), (self.ring_scales, levers.ring_scales)]
        pairs = [
            (self.codes, codes),
            (self.exact, levers.exact),
            *ring,
            (self.mean, levers.mean),
            (self.mean_rotated, levers.mean_rotated),
        ]
        row = [0 if mine is None else _elements_from(base, mine) for base, mine in pairs]
        assert row[0] % CODES_ALIGNMENT == 0, "a store must start 16-byte aligned"
        return [*row, codes.shape[0]]


def _elements_from(base: torch.Tensor, tensor: torch.Tensor) -> int:
    """Elements of `tensor`'s dtype from base's first element to tensor's (same dtype)."""
    assert base.dtype == tensor.dtype and base.device == tensor.device
    gap = tensor.data_ptr() - base.data_ptr()
    assert gap % tensor.element_size() == 0, "a state tensor not aligned to its element size"
    return gap // tensor.element_size()


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
    """One decode step of one layer. q: [Hq, 1, D] attends over the coded rows in `codes`
    (uint8 [slots, row_bytes] by plane, contiguous; token t in slot t mod slots), the exact rows of
    `levers` and the exact new row k_new, v_new: [Hkv, 1, D]; then the row leaving the exact
    ones (without levers: the new row) is encoded into its slot and the new row kept exact.
    position: [1] int64 on the device; meta: `single_meta(codes)` kept on the device (a
    captured step reads it; None: made here); `use_cuda_partial`: as `batched_attention` takes it.
    → [Hq, 1, D] in q's dtype."""
    heads, _, dim = q.shape
    kv_heads = k_new.shape[0]
    if levers is None:
        levers = Levers.none(kv_heads, tables, q.device)
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
        use_cuda_partial=use_cuda_partial,
    )
    return out.view(heads, 1, dim)


def single_meta(codes: torch.Tensor) -> torch.Tensor:
    """The `meta` of a launch for one session given its own tensors: [1, META] int64."""
    row = [0] * (META.value - 1) + [codes.shape[0]]
    return torch.tensor([row], dtype=torch.long, device=codes.device)


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
    """One decode step of one layer for B sessions: `attention` for each, session b's state
    reached from `operands` by the offsets in meta[b] (and its store's slots there, each
    ≤ max_slots, which fixes the launch's shape), its position positions[b]. q: [B, Hq, D],
    k_new, v_new: [B, Hkv, D]; `levers`: the layer's (their tensors are not read here — the
    operands are — but their counts and flags are every session's); `n_splits`: programs per
    (sequence, K/V head), a power of two ≤ MAX_SPLITS (None: `splits(max_slots)`);
    `use_cuda_partial`: the queries' rotation and the partial launch in one CUDA C++ launch where it
    covers the layer and builds here (`cuda_partial_kernel`), else (and with False) the Triton
    launches. → [B, Hq, D]."""
    batch, heads, dim = q.shape
    kv_heads = k_new.shape[1]
    group = heads // kv_heads
    dp = tables.rotated_dim
    assert operands.codes.is_contiguous()
    if workspace is None:
        workspace = Workspace.of(heads, kv_heads, tables, q.device, batch)
    assert workspace.m.shape[0] >= batch * kv_heads, "a workspace too small for the batch"
    if levers is None:
        levers = Levers.none(kv_heads, tables, q.device)
    constants = levers.constants()
    combine_rows = _combine_rows(group, dp, constants["EC"])
    gp = workspace.m.shape[-1]  # the states' rows: the partial launch's query rows
    assert gp >= max(group, combine_rows), "a workspace made for fewer query rows"
    shape = {"G": group, "GP": gp, "D": dim, "DP": dp, "HKV": kv_heads}
    common = {"BPV": tables.bytes_per_vector, "BITS": tables.bits, "SOFTCAP": softcap > 0.0}
    q = q.contiguous()
    row_bytes = 2 * kv_heads * tables.bytes_per_vector
    assert launch_indices_fit(max_slots, row_bytes), "a store past 2 GiB needs 64-bit indices"
    norms = operands.codes.view(torch.float32)
    k_new, v_new = k_new.contiguous(), v_new.contiguous()
    exact_keys = ("SINKS", "RECENT", "RING", "EP", "CENTER", "RING8")
    exact_rows = {key: constants[key] for key in exact_keys}
    compiled = None
    if use_cuda_partial:
        compiled = cuda_partial_kernel(
            q.device, q.dtype, operands.exact.dtype, heads, kv_heads, tables, levers, softcap, gp
        )
    if compiled is not None:  # the rotation and partial launches in one, in CUDA C++
        if n_splits is None:
            n_splits = cuda_partial.splits(max_slots, batch * kv_heads)
        cuda_partial.launch(
            compiled,
            q,
            tables.rotation,
            k_new,
            v_new,
            operands.codes,
            operands.exact,
            tables.centroids,
            operands.mean_rotated,
            meta,
            positions,
            workspace.m,
            workspace.l_sum,
            workspace.acc,
            n_splits,
            levers.keep,
            scale,
        )
    else:
        n_splits = batch_splits(max_slots, batch * kv_heads) if n_splits is None else n_splits
        _partial_launches(
            q,
            k_new,
            v_new,
            operands,
            norms,
            meta,
            positions,
            max_slots,
            tables,
            scale,
            softcap,
            workspace,
            levers,
            n_splits,
            shape,
            common,
            exact_rows,
            combine_rows,
            constants,
        )
    out = torch.empty((batch, heads, dim), dtype=q.dtype, device=q.device)
    _attention_combine[(kv_heads, 2, batch)](
        tables.rotation,
        tables.boundaries,
        tables.centroids,
        k_new,
        v_new,
        operands.codes,
        norms,
        operands.exact,
        operands.ring,
        operands.ring_scales,
        operands.mean,
        meta,
        positions,
        workspace.m,
        workspace.l_sum,
        workspace.acc,
        out,
        G=group,
        GP=gp,
        D=dim,
        DP=dp,
        HKV=kv_heads,
        BPV=tables.bytes_per_vector,
        BITS=tables.bits,
        **exact_rows,
        R=combine_rows,
        NORM_FIX=tables.norm_correction,
        NS=n_splits,
        # 8 warps: at Triton's default 4 this program spilled registers and took 55 µs on an
        # H200 instead of 6.5 (docs/PERFORMANCE.md)
        num_warps=COMBINE_WARPS,
        **dependent_options(q.device),
    )
    return out


def cuda_partial_kernel(
    device: torch.device,
    dtype: torch.dtype,
    exact_dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    tables: CodecTables,
    levers: Levers,
    softcap: float,
    state_rows: int,
) -> object | None:
    """The CUDA C++ partial launch for a layer's step (queries of `dtype`, exact rows of
    `exact_dtype`, `state_rows` query rows a workspace state), where it covers the case and can
    be built here (`cuda_partial`), else None: the Triton launches run."""
    if device.type != "cuda" or interpreted():
        return None
    group = heads // kv_heads
    covered = (
        tables.bits == 4
        and tables.dim == tables.rotated_dim == cuda_partial.HEAD_DIM
        and dtype == exact_dtype == torch.bfloat16
        and softcap == 0.0
        and levers.ring is None
        and levers.keep == FULL_LAYER_KEEP
        and group <= cuda_partial.MAX_GROUP
    )
    if not covered:
        return None
    config = cuda_partial.Config(
        kv_heads,
        group,
        levers.sinks,
        levers.recent,
        ring_slots(levers.recent),
        levers.center,
        state_rows,
    )
    return cuda_partial.kernel(config, device)


def _partial_launches(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    operands: Operands,
    norms: torch.Tensor,
    meta: torch.Tensor,
    positions: torch.Tensor,
    max_slots: int,
    tables: CodecTables,
    scale: float,
    softcap: float,
    workspace: Workspace,
    levers: Levers,
    n_splits: int,
    shape: dict[str, int],
    common: dict[str, int | bool],
    exact_rows: dict[str, int | bool],
    combine_rows: int,
    constants: dict[str, int | bool],
) -> None:
    """The Triton rotation and partial launches: the split and exact-rows states into the
    workspace."""
    batch, kv_heads = k_new.shape[0], k_new.shape[1]
    dim, dp, group, gp = shape["D"], shape["DP"], shape["G"], shape["GP"]
    per_split = _next_power_of_two(max(1, -(-max_slots // (BLOCK_N * n_splits))))
    _rotate_queries[(kv_heads, batch)](
        q,
        tables.rotation,
        workspace.queries,
        G=group,
        GP=gp,
        D=dim,
        DP=dp,
        HKV=kv_heads,
        PRECISION=precision(q.dtype),
        **dependent_options(q.device),
    )
    _attention_partial[(kv_heads, n_splits + 1, batch)](
        q,
        workspace.queries,
        k_new,
        v_new,
        operands.codes,
        norms,
        operands.exact,
        operands.ring,
        operands.ring_scales,
        tables.centroids,
        operands.mean_rotated,
        meta,
        positions,
        workspace.m,
        workspace.l_sum,
        workspace.acc,
        levers.keep,
        scale,
        softcap,
        **shape,
        **common,
        **exact_rows,
        R=combine_rows,
        EC=constants["EC"],
        BLOCKS_PER_SPLIT=per_split,
        NS=n_splits,
        BLOCK=BLOCK_N,
        STAGES=STAGES,
        NIBBLES=tables.bits == 4 and dp >= 2 * _MIN_DOT,
        WRAPS=levers.keep != FULL_LAYER_KEEP,
        LOOKUP=tables.lookups.get(q.dtype, ""),
        num_warps=PARTIAL_WARPS,
        **dependent_options(q.device),
    )


def encode(x: torch.Tensor, tables: CodecTables, mean: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, D] → uint8 [N, bytes_per_vector], `TurboQuantCodec.encode`'s layout; with `mean`
    [M, D] float32, of x − mean[i mod M] (vector i)."""
    n, dim = x.shape
    codes = torch.empty((n, tables.bytes_per_vector), dtype=torch.uint8, device=x.device)
    if n == 0:
        return codes
    center = mean is not None
    if mean is None:
        mean = torch.zeros((1, dim), dtype=torch.float32, device=x.device)
    _encode[(n,)](
        x.contiguous(),
        tables.rotation,
        tables.boundaries,
        tables.centroids,
        mean.contiguous(),
        codes,
        codes.view(torch.float32),
        M=mean.shape[0],
        D=dim,
        DP=tables.rotated_dim,
        BITS=tables.bits,
        BPV=tables.bytes_per_vector,
        CENTER=center,
        NORM_FIX=tables.norm_correction,
    )
    return codes
