"""Batched decode: several sessions' decode steps in one forward pass give each session what it
gets alone (bit for bit on the CPU's compiled path with the default model's block weights, the
same greedy tokens on the float path), engines that cannot batch say so, and the server's
scheduler batches concurrent streams without changing their tokens."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quantize

import larql.server.scheduler as scheduler_module
from larql.inference.batching import batch_groups, decode_batch
from larql.inference.errors import InvariantViolation
from larql.inference.ffn import DenseFfn
from larql.inference.generation import GenerationSession, generate, step_together
from larql.kernels.cpu.build import load as load_block_kernels
from larql.kv import parse_engine
from larql.models import Model
from larql.models.blocks import FORMAT_CODES, GGUF_FORMATS, BlockRows
from larql.server.metrics import ServerMetrics
from larql.server.scheduler import DoneEvent, Scheduler, SchedulerLimits
from test_server_scheduler import events_of, request

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
]


def _sessions(model: Model, spec: str, steps: int) -> list[GenerationSession]:
    ffn = DenseFfn(model)
    out = []
    for prompt in PROMPTS:
        ids = model.tokenizer.encode(prompt)
        engine = parse_engine(spec).build(model)
        session = GenerationSession(engine, model, ffn, ids, steps, stop_ids=frozenset())
        session.prefill()
        out.append(session)
    return out


def _alone_and_batched(
    model: Model, spec: str, steps: int
) -> tuple[list[GenerationSession], list[GenerationSession]]:
    alone = _sessions(model, spec, steps)
    for session in alone:
        while not session.finished:
            session.step()
    batched = _sessions(model, spec, steps)
    while not batched[0].finished:
        step_together(batched)
    return alone, batched


@pytest.mark.parametrize("spec", ["standard", "standard:window=6", "turbo-quant", "kv-quant"])
def test_batched_steps_are_bit_identical_on_the_default_model(
    smollm2_default: Model, spec: str
) -> None:
    if load_block_kernels() is None:
        pytest.skip("the CPU block kernels are not built")
    alone, batched = _alone_and_batched(smollm2_default, spec, 12)
    for a, b in zip(alone, batched, strict=True):
        assert a.tokens == b.tokens
        assert a.logits is not None and b.logits is not None
        assert torch.equal(a.logits, b.logits)
    assert len({tuple(s.tokens) for s in batched}) == len(PROMPTS)  # different streams


@pytest.mark.parametrize("spec", ["standard", "standard:window=6"])
def test_batched_steps_on_the_float_path_give_the_same_greedy_tokens(
    smollm2: Model, spec: str
) -> None:
    """BLAS sums a many-row product in another order than a one-row one: the exact engines'
    tokens stay equal. (A quantising engine may round a value on a cell boundary to the
    neighbouring cell there and diverge later — seen with turbo-quant on some machines — so
    it is held bit-identical on the block path, the default, above.)"""
    alone, batched = _alone_and_batched(smollm2, spec, 16)
    for a, b in zip(alone, batched, strict=True):
        assert a.tokens == b.tokens
        assert torch.allclose(a.logits, b.logits, atol=1e-3, rtol=0)


def test_block_product_of_many_rows_is_each_rows_product() -> None:
    kernels = load_block_kernels()
    if kernels is None:
        pytest.skip("the CPU block kernels are not built")
    rng = np.random.default_rng(0)
    for qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        weights = rng.standard_normal((70, 96)).astype(np.float32)
        rows = BlockRows.from_numpy(GGUF_FORMATS[qtype], quantize(weights, qtype), (70, 96))
        x = torch.randn(11, 96, generator=torch.Generator().manual_seed(2))  # a tile of 8 + 3
        for bits in (0, 8, 16):
            many = kernels.block_gemm(x, rows.data, FORMAT_CODES[rows.format], bits)
            for m in range(x.shape[0]):
                row = x[m].contiguous()
                one = kernels.block_gemv(row, rows.data, FORMAT_CODES[rows.format], bits)
                assert torch.equal(many[m], one), (qtype.name, bits, m)


def test_engines_that_cannot_batch_step_alone(smollm2: Model) -> None:
    ffn = DenseFfn(smollm2)
    ids = smollm2.tokenizer.encode(PROMPTS[0])
    specs = ["standard", "standard", "no-cache", "standard:window=8", "turbo-quant"]
    specs += ["standard:window=8,sinks=2", "standard"]
    engines = [parse_engine(s).build(smollm2) for s in specs]
    for engine in engines:
        engine.prefill(smollm2, ffn, ids)
    # one group per batch key, in first-seen order; no-cache and sinks have none: alone
    assert batch_groups(engines) == [[0, 1, 6], [3], [4], [2], [5]]
    with pytest.raises(InvariantViolation, match="batch_key"):
        decode_batch(engines[:3], smollm2, ffn, [1, 2, 3])
    with pytest.raises(InvariantViolation, match="twice"):
        decode_batch([engines[0], engines[0]], smollm2, ffn, [1, 2])
    fresh = parse_engine("standard").build(smollm2)
    assert fresh.batch_key() is None  # nothing to batch before its prefill


def test_the_server_batches_concurrent_streams_without_changing_their_tokens(
    smollm2_default: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int] = []
    real = scheduler_module.step_together

    def counting(sessions):  # type: ignore[no-untyped-def]
        sizes.append(len(sessions))
        return real(sessions)

    monkeypatch.setattr(scheduler_module, "step_together", counting)
    model = smollm2_default

    async def scenario() -> list[list]:
        s = Scheduler(model, DenseFfn(model), SchedulerLimits(max_sessions=4), ServerMetrics())
        loop = asyncio.get_running_loop()
        engines = [parse_engine("standard").build(model) for _ in range(4)]
        sessions = [s.submit(request(model, 10, ignore_eos=True), e, loop) for e in engines]
        results = await asyncio.gather(*(events_of(x) for x in sessions))
        s.close()
        return results

    results = asyncio.run(scenario())
    ids = model.tokenizer.encode("The capital of France is")
    ffn = DenseFfn(model)
    engine = parse_engine("standard").build(model)
    alone = generate(engine, model, ffn, ids, 10, stop_ids=frozenset())
    for events in results:
        assert isinstance(events[-1], DoneEvent)
        assert list(events[-1].token_ids) == alone.tokens
    assert max(sizes) == 4  # all four decoded in one step


def test_the_catalog_says_which_engines_batch() -> None:
    from larql.kv.catalog import catalog_rows

    rows = {row["name"]: row for row in catalog_rows()}
    assert rows["standard"]["batching"].startswith("yes")
    assert rows["turbo-quant"]["batching"].startswith("yes")
    assert rows["no-cache"]["batching"] is None  # steps alone


def test_a_long_prompt_goes_in_chunks_between_the_running_streams_steps(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a stream decodes, a new 40-token prompt is prefilled 16 tokens a turn with the
    stream's steps in between; both get the tokens they get alone."""
    turns: list[str] = []
    real_part, real_step = GenerationSession.prefill_part, GenerationSession.step

    def part(self, max_tokens):  # type: ignore[no-untyped-def]
        turns.append(f"prefill {max_tokens}")
        return real_part(self, max_tokens)

    def step(self):  # type: ignore[no-untyped-def]
        turns.append("step")
        return real_step(self)

    monkeypatch.setattr(GenerationSession, "prefill_part", part)
    monkeypatch.setattr(GenerationSession, "step", step)
    model, ffn = smollm2, DenseFfn(smollm2)
    long_ids = tuple(model.tokenizer.encode(" ".join(["The quick brown fox jumps."] * 7)))[:40]
    short = request(model, 24, ignore_eos=True)
    long = dataclasses.replace(short, prompt_ids=long_ids, max_new_tokens=6)

    async def scenario() -> tuple[list, list]:
        limits = SchedulerLimits(max_sessions=2, prefill_chunk=16)
        s = Scheduler(model, ffn, limits, ServerMetrics())
        loop = asyncio.get_running_loop()
        first = s.submit(short, parse_engine("standard").build(model), loop)
        await asyncio.wait_for(first.events.get(), 60)  # it is decoding
        second = s.submit(long, parse_engine("standard").build(model), loop)
        results = await asyncio.gather(events_of(first), events_of(second))
        s.close()
        return results[0], results[1]

    first_events, second_events = asyncio.run(scenario())
    first_chunk = turns.index("prefill 16")
    # 16 + 16 + 8 tokens, each chunk followed by a step of the running stream
    assert turns[first_chunk : first_chunk + 6] == ["prefill 16", "step"] * 3
    for events, req in ((second_events, long), (first_events, short)):
        alone = generate(
            parse_engine("standard").build(model), model, ffn, list(req.prompt_ids),
            req.max_new_tokens, stop_ids=frozenset(),
        )  # fmt: skip
        assert isinstance(events[-1], DoneEvent)
        assert list(events[-1].token_ids) == alone.tokens
