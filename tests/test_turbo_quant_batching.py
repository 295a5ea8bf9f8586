"""turbo-quant's kernel path batched: sessions of three lengths, each with its own stores grown
at its own steps, decode in one step (`BatchedKernelStep`: every session's attention and
encoding in two launches a layer) and get the tokens and logits they get alone. The kernels
run compiled on CUDA, in Triton's interpreter on a CPU machine."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

import larql.kv.turbo_quant.kernel_path as kernel_path_module
from helpers import greedy_streams, kernel_module, model_for_kernels, relative_error
from larql.inference.batching import batch_groups
from larql.inference.ffn import DenseFfn
from larql.kv import parse_engine
from larql.kv.captured_step import next_power_of_two
from larql.kv.turbo_quant import TurboQuantEngine, planes
from larql.kv.turbo_quant.codec import TurboQuantCodec
from larql.kv.turbo_quant.layout import ring_slots
from larql.models import Model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

PROMPTS = ["The capital of France is", "Alice put the red ball in the box, and Bob", "One two"]


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return kernel_module("larql.kv.turbo_quant.kernels")


LEVERS = {"recent": 3, "sinks": 2, "norm_correction": True, "center": True}  # rings that wrap


def _decode(
    model: Model, engines: list[TurboQuantEngine], steps: int, batched: bool
) -> tuple[list[list[int]], torch.Tensor]:
    return greedy_streams(model, engines, PROMPTS, steps, batched)


@pytest.mark.slow
def test_kernel_path_sessions_batched_give_their_tokens_alone(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel_module("larql.kv.turbo_quant.kernels")
    model = model_for_kernels(smollm2, monkeypatch, interpreted_layers=1)
    # stores just above each prompt: they grow (and move) at different steps
    monkeypatch.setattr(kernel_path_module, "initial_capacity", lambda n: next_power_of_two(n + 1))
    alone = [TurboQuantEngine(**LEVERS) for _ in PROMPTS]
    alone_tokens, alone_logits = _decode(model, alone, 4, batched=False)
    engines = [TurboQuantEngine(**LEVERS) for _ in PROMPTS]
    batched_tokens, batched_logits = _decode(model, engines, 4, batched=True)
    assert all("triton kernels" in e.info().description for e in engines)
    assert batched_tokens == alone_tokens
    assert len({tuple(t) for t in batched_tokens}) == len(PROMPTS)
    # a float rounding apart (the rows' projections in one product) can move a coordinate
    # across a codebook boundary: the states then differ by a code, not the path
    assert torch.allclose(batched_logits, alone_logits, atol=1e-3, rtol=0)
    capacities = {e._fast.capacity for e in engines if e._fast is not None}
    assert len(capacities) > 1  # the sessions' stores grew apart


def _session(kernels, tables, codec, kv_heads: int, slots: int, seed: int):
    """A layer's state with the catalog's levers (2 sinks, 3 recent rows, centering): random
    codes in `slots` slots, random exact rows and mean → (codes, levers)."""
    generator = torch.Generator().manual_seed(seed)
    dim = codec.dim
    vectors = torch.randn(slots * 2 * kv_heads, dim, generator=generator)
    codes = planes.from_rows(
        codec.encode(vectors).view(slots, -1).to(DEVICE), codec.bytes_per_vector
    )
    exact = torch.randn(2 + ring_slots(3), 2, kv_heads, dim, generator=generator)
    mean = torch.randn(2, kv_heads, dim, generator=generator) * 0.1
    levers = kernels.Levers(
        exact=exact.to(DEVICE),
        mean=mean.to(DEVICE),
        mean_rotated=(mean @ tables.rotation.cpu()).to(DEVICE),
        sinks=2,
        recent=3,
        center=True,
    )
    return codes, levers


def test_the_batched_launch_is_each_sessions_own_launch(kernels: ModuleType) -> None:
    """Three sessions with stores of different sizes at different positions: one batched launch
    (state reached by offsets from an anchor, a pad row at position 0) gives each session's
    attention as its own launch does, and leaves the same bytes in its state."""
    heads, kv_heads, dim = 9, 3, 64
    codec = TurboQuantCodec(dim, 4, norm_correction=True)
    tables = kernels.CodecTables.of(codec, DEVICE)
    sizes, positions = [64, 256, 16], [40, 200, 9]
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(4, heads, dim, generator=generator).to(DEVICE)
    k_new, v_new = (torch.randn(4, kv_heads, dim, generator=generator).to(DEVICE) for _ in "kv")
    alone = [_session(kernels, tables, codec, kv_heads, n, n) for n in sizes]
    together = [_session(kernels, tables, codec, kv_heads, n, n) for n in sizes]
    pad = _session(kernels, tables, codec, kv_heads, 1, 0)
    outs = []
    for b, ((codes, levers), position) in enumerate(zip(alone, positions, strict=True)):
        at = torch.tensor([position], device=DEVICE)
        out = kernels.attention(
            q[b, :, None],
            k_new[b, :, None],
            v_new[b, :, None],
            codes,
            at,
            tables,
            dim**-0.5,
            0.0,
            None,
            levers,
        )
        outs.append(out[:, 0])
    anchor = torch.zeros(16, dtype=torch.uint8, device=DEVICE)
    operands = kernels.Operands.anchored(anchor, torch.float32)
    meta = torch.tensor([operands.offsets(c, lv) for c, lv in [*together, pad]], device=DEVICE)
    out = kernels.batched_attention(
        q,
        k_new,
        v_new,
        operands,
        meta,
        torch.tensor([*positions, 0], device=DEVICE),
        max(sizes),
        tables,
        dim**-0.5,
        0.0,
        None,
        together[0][1],
    )
    assert relative_error(out[:3], torch.stack(outs)) <= 1e-6
    for (codes, levers), (codes_batched, levers_batched) in zip(alone, together, strict=True):
        assert torch.equal(codes, codes_batched)
        assert torch.equal(levers.exact, levers_batched.exact)


def test_kernel_path_engines_batch_with_their_own_configuration(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel_module("larql.kv.turbo_quant.kernels")
    model = model_for_kernels(smollm2, monkeypatch, interpreted_layers=1)
    ffn = DenseFfn(model)
    ids = model.tokenizer.encode(PROMPTS[2])
    specs = ["turbo-quant", "turbo-quant:attention=sdpa", "turbo-quant", "turbo-quant:bits=3"]
    engines = [parse_engine(spec).build(model) for spec in specs]
    with torch.inference_mode():
        for engine in engines:
            engine.prefill(model, ffn, ids)
    assert batch_groups(engines) == [[0, 2], [1], [3]]
