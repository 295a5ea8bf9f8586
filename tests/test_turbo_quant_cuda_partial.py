"""turbo-quant's CUDA C++ partial launch (`cuda_partial`, `partial.cu`) against the Triton
launches it replaces, from the same states: the split counts everywhere; the launch itself,
and the engine on the default model in bfloat16, on a CUDA machine (skipped elsewhere)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from helpers import greedy_streams, kernel_module, relative_error
from larql.kv import parse_engine
from larql.kv.turbo_quant import cuda_partial, planes
from larql.kv.turbo_quant.codec import TurboQuantCodec
from larql.kv.turbo_quant.layout import ring_slots
from larql.models import load_model

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="the CUDA C++ launch needs a CUDA device")
DEVICE = torch.device("cuda" if CUDA else "cpu")


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return kernel_module("larql.kv.turbo_quant.kernels")


@pytest.mark.parametrize(
    ("max_slots", "pairs", "expected"),
    [
        (32768, 8, 16),  # the 1B shape at depth 32,000: 128 CTAs
        (32768, 16, 8),  # two sessions share the wave
        (32768, 512, 1),  # 64 sessions: one CTA each
        (4096, 3, 16),  # SmolLM2's 3 K/V heads: 42 wanted, 16 whole groups a warp at most
        (256, 8, 1),  # a short store: every warp of one CTA still gets a load group
        (1 << 20, 1, cuda_partial.MAX_SPLITS),  # no more states than the workspace holds
    ],
)
def test_splits_fill_one_wave_and_give_every_warp_a_load_group(
    max_slots: int, pairs: int, expected: int
) -> None:
    assert cuda_partial.splits(max_slots, pairs) == expected


def test_the_shared_memory_lets_two_ctas_share_an_sm() -> None:
    """The table (64 KiB) and the scratch after it: two CTAs an SM need ≤ 113 KiB each on an
    H100/H200 (228 KiB an SM, 1 KiB of it reserved a CTA)."""
    assert 64 * 1024 < cuda_partial.shared_bytes() <= 113 * 1024


@needs_cuda
def test_the_triton_launches_run_where_the_cuda_launch_does_not_cover(kernels) -> None:
    """float32 queries, a soft cap, a sliding layer, 3-bit codes: the Triton launches."""
    tables = kernels.CodecTables.of(TurboQuantCodec(64, 4), DEVICE)
    levers = kernels.Levers.none(8, tables, DEVICE)
    bf16 = torch.bfloat16
    sliding = kernels.Levers(levers.exact, levers.mean, levers.mean_rotated, keep=512)
    three_bits = kernels.CodecTables.of(TurboQuantCodec(64, 3), DEVICE)
    cases = [
        (torch.float32, torch.float32, tables, levers, 0.0),
        (bf16, bf16, tables, levers, 50.0),
        (bf16, bf16, tables, sliding, 0.0),
        (bf16, bf16, three_bits, levers, 0.0),
    ]
    for dtype, exact, tab, lev, softcap in cases:
        kernel = kernels.cuda_partial_kernel(DEVICE, dtype, exact, 32, 8, tab, lev, softcap, 8)
        assert kernel is None


def _layer_state(kernels, tables, codec, kv_heads, slots, sinks, recent, center, seed):
    """Random codes in every slot, random 16-bit exact rows, a random mean (centering)."""
    generator = torch.Generator().manual_seed(seed)
    dim = codec.dim
    vectors = torch.randn(slots * 2 * kv_heads, dim, generator=generator)
    codes = planes.from_rows(
        kernels.encode(vectors.to(DEVICE), tables).view(slots, -1), tables.bytes_per_vector
    )
    rows = sinks + (ring_slots(recent) if recent else 0)
    exact = torch.randn(max(1, rows), 2, kv_heads, dim, generator=generator)
    mean = torch.randn(2, kv_heads, dim, generator=generator) * (0.3 if center else 0.0)
    levers = kernels.Levers(
        exact=exact.to(DEVICE, torch.bfloat16),
        mean=mean.to(DEVICE),
        mean_rotated=(mean @ tables.rotation.cpu()).to(DEVICE),
        sinks=sinks,
        recent=recent,
        center=center,
    )
    return codes, levers


def _batched(kernels, tables, q, k_new, v_new, states, positions, max_slots, use_cuda_partial):
    anchor = torch.zeros(16, dtype=torch.uint8, device=DEVICE)
    operands = kernels.Operands.anchored(anchor, torch.bfloat16)
    meta = torch.tensor([operands.offsets(c, lv) for c, lv in states], device=DEVICE)
    at = torch.tensor(positions, device=DEVICE)
    return kernels.batched_attention(
        q,
        k_new,
        v_new,
        operands,
        meta,
        at,
        max_slots,
        tables,
        q.shape[-1] ** -0.5,
        0.0,
        None,
        states[0][1],
        use_cuda_partial=use_cuda_partial,
    )


@needs_cuda
@pytest.mark.parametrize(
    ("heads", "kv_heads", "sinks", "recent", "center", "positions", "slots"),
    [
        (32, 8, 4, 32, True, [32000], 32768),  # the 1B shape at depth, the catalog's levers
        (32, 8, 0, 0, False, [4097], 8192),  # every row coded, a partial last group
        (9, 3, 4, 128, True, [5000, 131, 2], 8192),  # SmolLM2's heads; no coded row; in the sinks
        (8, 1, 2, 3, True, [1000, 999], 1024),  # a group of 8 query heads
        (12, 4, 4, 16, False, [77], 128),
    ],
)
def test_the_cuda_launch_gives_the_triton_launches_attention_and_store(
    kernels, heads, kv_heads, sinks, recent, center, positions, slots
) -> None:
    """The same sessions' states, one launch with the CUDA partial, one with the Triton ones: the
    same attention (to the bfloat16 rounding of the rotated queries) and the same bytes left in
    every state (the combine launch moves the rows in both)."""
    codec = TurboQuantCodec(64, 4, norm_correction=True)
    tables = kernels.CodecTables.of(codec, DEVICE)
    generator = torch.Generator().manual_seed(sum(positions))
    batch = len(positions)
    q = torch.randn(batch, heads, 64, generator=generator).to(DEVICE, torch.bfloat16)
    k_new, v_new = (
        torch.randn(batch, kv_heads, 64, generator=generator).to(DEVICE, torch.bfloat16)
        for _ in "kv"
    )
    states = {
        path: [
            _layer_state(kernels, tables, codec, kv_heads, slots, sinks, recent, center, b)
            for b in range(batch)
        ]
        for path in ("cuda", "triton")
    }
    compiled = kernels.cuda_partial_kernel(
        DEVICE,
        torch.bfloat16,
        torch.bfloat16,
        heads,
        kv_heads,
        tables,
        states["cuda"][0][1],
        0.0,
        kernels.Workspace.of(heads, kv_heads, tables, DEVICE).m.shape[-1],
    )
    assert compiled is not None, cuda_partial.unavailable()
    ours = _batched(kernels, tables, q, k_new, v_new, states["cuda"], positions, slots, True)
    theirs = _batched(kernels, tables, q, k_new, v_new, states["triton"], positions, slots, False)
    assert relative_error(ours.float(), theirs.float()) <= 2e-2
    for (codes, levers), (their_codes, their_levers) in zip(*states.values(), strict=True):
        assert torch.equal(codes, their_codes)
        assert torch.equal(levers.exact, their_levers.exact)


@needs_cuda
@pytest.mark.slow
def test_the_engine_on_the_cuda_launch_decodes_as_on_the_triton_ones() -> None:
    """The default model in bfloat16 on CUDA with the catalog's turbo-quant: a prompt longer
    than the exact rows, so most rows are coded, and greedy steps with the CUDA partial launch
    (`attention=auto`) and with the Triton launches (`attention=triton`)."""
    model = load_model("smollm2-135m", dtype=torch.bfloat16, device="cuda")
    text = "The quick brown fox jumps over the lazy dog. " * 40
    prompt = model.tokenizer.decode(model.tokenizer.encode(text)[:400])
    runs = {}
    for path in ("auto", "triton"):
        engine = parse_engine(f"turbo-quant:attention={path}").build(model)
        runs[path] = greedy_streams(model, [engine], [prompt], 8, batched=False)
        described = engine.info().description
        assert ("CUDA C++ partial launch" in described) == (path == "auto"), described
    (ours, our_logits), (theirs, their_logits) = runs["auto"], runs["triton"]
    assert ours == theirs
    assert relative_error(our_logits.float(), their_logits.float()) <= 5e-2
