"""Batched decode: several sessions' decode steps in one forward pass give each session what it
gets alone (bit for bit on the CPU's compiled path with the default model's block weights, the
same greedy tokens on the float path), engines that cannot batch say so, and the server's
scheduler batches concurrent streams without changing their tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quantize

import larql.server.steps as steps_module
from helpers import torch_threads
from larql.inference.batching import advance_batch, batch_groups, decode_batch
from larql.inference.errors import InvariantViolation
from larql.inference.ffn import DenseFfn
from larql.inference.generation import (
    GenerationSession,
    advance_together,
    generate,
    step_together,
)
from larql.inference.linear import model_block_rows, rows_per_pass
from larql.kernels.cpu import cpu_extension
from larql.kv import parse_engine
from larql.kv.standard.engine import StandardEngine
from larql.models import Model, load_model
from larql.models.blocks import FORMAT_CODES, GGUF_FORMATS, BlockRows
from larql.server.metrics import ServerMetrics
from larql.server.scheduler import DoneEvent, Scheduler, SchedulerLimits, SessionRequest
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
        gen = GenerationSession(engine, model, ffn, ids, steps, stop_ids=frozenset())
        gen.prefill()
        out.append(gen)
    return out


def _alone_and_batched(
    model: Model, spec: str, steps: int
) -> tuple[list[GenerationSession], list[GenerationSession]]:
    alone = _sessions(model, spec, steps)
    for gen in alone:
        while not gen.finished:
            gen.step()
    batched = _sessions(model, spec, steps)
    while not batched[0].finished:
        step_together(batched)
    return alone, batched


@pytest.mark.parametrize("spec", ["standard", "standard:window=6", "turbo-quant", "kv-quant"])
@pytest.mark.slow
def test_batched_steps_are_bit_identical_on_the_default_model(
    smollm2_default: Model, spec: str
) -> None:
    if cpu_extension() is None:
        pytest.skip("the CPU block kernels are not built")
    alone, batched = _alone_and_batched(smollm2_default, spec, 12)
    for a, b in zip(alone, batched, strict=True):
        assert a.tokens == b.tokens
        assert a.logits is not None and b.logits is not None
        assert torch.equal(a.logits, b.logits)
    assert len({tuple(s.tokens) for s in batched}) == len(PROMPTS)  # different streams


@pytest.mark.slow
def test_steps_on_two_threads_are_the_one_thread_steps(smollm2_default: Model) -> None:
    """The compiled layers split their products, attention and rounding over the threads (the
    suite's workers run one thread each): on two, every session's steps, alone and batched,
    give the one-thread logits bit for bit."""
    if cpu_extension() is None:
        pytest.skip("the CPU block kernels are not built")
    runs = []
    for count in (1, 2):
        with torch_threads(count):
            runs.append(_alone_and_batched(smollm2_default, "standard", 8))
    (alone_1, batched_1), (alone_2, batched_2) = runs
    for one, two in zip([*alone_1, *batched_1], [*alone_2, *batched_2], strict=True):
        assert one.tokens == two.tokens
        assert one.logits is not None and two.logits is not None
        assert torch.equal(one.logits, two.logits)


@pytest.mark.slow
def test_batched_steps_with_int8_inputs_are_bit_identical() -> None:
    """`--weights blocks-int8` (llama.cpp's int8 inputs; tiled products where the CPU has
    AVX-512 VNNI): a batched step is each session's step alone, bit for bit, too."""
    if cpu_extension() is None:
        pytest.skip("the CPU block kernels are not built")
    model = load_model("smollm2-135m", weights="blocks-int8")
    alone, batched = _alone_and_batched(model, "standard", 10)
    for a, b in zip(alone, batched, strict=True):
        assert a.tokens == b.tokens
        assert a.logits is not None and b.logits is not None
        assert torch.equal(a.logits, b.logits)


@pytest.mark.parametrize(
    "spec",
    [
        # long: window=6 runs the same many-row float products; standard is bit for bit above
        pytest.param("standard", marks=pytest.mark.long),
        "standard:window=6",
    ],
)
@pytest.mark.slow
def test_batched_steps_on_the_float_path_give_the_same_greedy_tokens(
    smollm2: Model, spec: str
) -> None:
    """BLAS sums a many-row product in another order than a one-row one: the exact engines'
    tokens stay equal. (A quantising engine may round a value on a cell boundary to the
    neighbouring cell there and diverge later — seen with turbo-quant on some machines — so
    it is held bit-identical on the block path, the default, above.)"""
    alone, batched = _alone_and_batched(smollm2, spec, 8)  # window=6: past it by step 2
    for a, b in zip(alone, batched, strict=True):
        assert a.tokens == b.tokens
        assert torch.allclose(a.logits, b.logits, atol=1e-3, rtol=0)


def test_block_product_of_many_rows_is_each_rows_product() -> None:
    kernels = cpu_extension()
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
    real = steps_module.step_together

    def counting(sessions):  # type: ignore[no-untyped-def]
        sizes.append(len(sessions))
        return real(sessions)

    monkeypatch.setattr(steps_module, "step_together", counting)
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
    assert rows["markov-rs"]["batching"].startswith("yes")
    assert rows["no-cache"]["batching"] is None  # steps alone


def _alone_tokens(model: Model, req: SessionRequest, spec: str = "standard") -> list[int]:
    return generate(
        parse_engine(spec).build(model),
        model,
        DenseFfn(model),
        list(req.prompt_ids),
        req.max_new_tokens,
        stop_ids=frozenset(),
    ).tokens


def _long_prompt(model: Model) -> tuple[int, ...]:
    return tuple(model.tokenizer.encode(" ".join(["The quick brown fox jumps."] * 7)))[:40]


def _a_long_prompt_beside_a_stream(
    model: Model, first_spec: str
) -> tuple[SessionRequest, SessionRequest, list, list]:
    """A 24-token stream of `first_spec` starts decoding; then a `standard` request with a
    40-token prompt arrives (`prefill_chunk` 16) → both requests and both event lists."""
    short = request(model, 24, ignore_eos=True)
    long = dataclasses.replace(short, prompt_ids=_long_prompt(model), max_new_tokens=6)

    async def scenario() -> tuple[list, list]:
        limits = SchedulerLimits(max_sessions=2, prefill_chunk=16)
        s = Scheduler(model, DenseFfn(model), limits, ServerMetrics())
        loop = asyncio.get_running_loop()
        first = s.submit(short, parse_engine(first_spec).build(model), loop)
        await asyncio.wait_for(first.events.get(), 60)  # it is decoding
        second = s.submit(long, parse_engine("standard").build(model), loop)
        results = await asyncio.gather(events_of(first), events_of(second))
        s.close()
        return results[0], results[1]

    first_events, second_events = asyncio.run(scenario())
    return short, long, first_events, second_events


@pytest.mark.parametrize("weights", ["blocks", "float"])
@pytest.mark.slow
def test_a_new_prompt_rides_in_the_running_streams_steps(
    weights: str,
    smollm2_default: Model,
    smollm2: Model,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While a stream decodes, a new 40-token prompt goes in riding in its steps, in chunks
    of at most `prefill_chunk` tokens a step (fewer where they fill the step's pass of rows):
    the running stream loses no step to it, and both
    get the tokens they get alone (the compiled layer of the block weights, and the torch
    operators of the float ones)."""
    model = smollm2_default if weights == "blocks" else smollm2
    steps: list[list[int]] = []  # per step: the prompt tokens each session took (0: decode)
    real = steps_module.advance_together

    def recording(sessions, chunks):  # type: ignore[no-untyped-def]
        steps.append([0 if s.started else c for s, c in zip(sessions, chunks, strict=True)])
        return real(sessions, chunks)

    monkeypatch.setattr(steps_module, "advance_together", recording)
    short, long, first_events, second_events = _a_long_prompt_beside_a_stream(model, "standard")
    # the prompt's chunks: 16 a step where the products cost by the row; else what fills the
    # decode row's pass (15 of AMX's 16 rows, 7 of the AVX2 tiles' 8) and, while at least
    # three quarters of another pass wait, whole passes more, up to 16 tokens
    sizes = {None: [16, 16, 8], 16: [15, 15, 10], 8: [15, 15, 7, 3]}[rows_per_pass(model)]
    assert steps == [[0, size] for size in sizes]  # the decode row, then the prompt's chunk
    for events, req in ((second_events, long), (first_events, short)):
        assert isinstance(events[-1], DoneEvent)
        assert list(events[-1].token_ids) == _alone_tokens(model, req)


@pytest.mark.slow
def test_a_prompt_that_cannot_ride_goes_in_chunks_between_the_steps(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new `standard` prompt cannot ride in a `turbo-quant` stream's steps: it is
    prefilled 16 tokens a turn with the stream's steps in between; both get the tokens they
    get alone."""
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
    model = smollm2
    short, long, first_events, second_events = _a_long_prompt_beside_a_stream(model, "turbo-quant")
    first_chunk = turns.index("prefill 16")
    # 16 + 16 + 8 tokens, each chunk followed by a step of the running stream
    assert turns[first_chunk : first_chunk + 6] == ["prefill 16", "step"] * 3
    for events, req, spec in (
        (second_events, long, "standard"),
        (first_events, short, "turbo-quant"),
    ):
        assert isinstance(events[-1], DoneEvent)
        assert list(events[-1].token_ids) == _alone_tokens(model, req, spec)


def _fresh(model: Model, prompt: str, spec: str = "standard", **kw) -> GenerationSession:  # type: ignore[no-untyped-def]
    engine = parse_engine(spec).build(model)
    ids = model.tokenizer.encode(prompt)
    return GenerationSession(engine, model, DenseFfn(model), ids, 6, stop_ids=frozenset(), **kw)


def test_prompts_ride_in_decode_steps_bit_for_bit(smollm2_default: Model) -> None:
    """Two streams decode while a short prompt goes in whole and a longer one in chunks, all
    in the same steps: every session's logits are the ones it gets alone, bit for bit on the
    compiled layer (a prompt of at most `model_block_rows` rows is prefilled by it alone too)."""
    model = smollm2_default
    long_text = "In the beginning the universe was created, which made a lot of people angry"
    texts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], long_text]
    assert len(model.tokenizer.encode(long_text)) <= model_block_rows(model)

    def alone(text: str) -> list[torch.Tensor]:
        gen, logits = _fresh(model, text), []
        gen.prefill()
        logits.append(gen.logits)
        while not gen.finished:
            gen.step()
            logits.append(gen.logits)
        return logits

    want = [alone(text) for text in texts]
    sessions = [_fresh(model, text) for text in texts]
    got: list[list[torch.Tensor]] = [[] for _ in texts]
    for gen in sessions[:2]:
        gen.prefill()
    got[0].append(sessions[0].logits)
    got[1].append(sessions[1].logits)
    chunks = {2: [100], 3: [5, 4, 100]}  # the third whole, the fourth in three chunks
    while not all(s.finished for s in sessions):
        live = [i for i, s in enumerate(sessions) if not s.finished]
        sizes = [1 if sessions[i].started else chunks[i].pop(0) for i in live]
        tokens = advance_together([sessions[i] for i in live], sizes)
        for i, token in zip(live, tokens, strict=True):
            if token is not None:
                got[i].append(sessions[i].logits)
    for mine, theirs in zip(got, want, strict=True):
        assert len(mine) == len(theirs)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_a_sessions_kv_is_allocated_once_for_its_tokens(smollm2_default: Model) -> None:
    """A session tells its engine how many tokens it will hold (`expect_tokens`): standard's
    K/V storage is allocated at the prefill for all of them and never moves in the steps,
    batched or alone, and every logit is what an engine told nothing gives (whose storage
    grows on the way)."""
    model, steps = smollm2_default, 40

    def run(hinted: bool, together: bool) -> tuple[list[torch.Tensor], set[int]]:
        sessions = []
        for prompt in PROMPTS[:2]:
            gen = _fresh(model, prompt)
            gen.budget = steps
            gen.engine.expect_tokens(len(gen.prompt_ids) + steps if hinted else 0)
            gen.prefill()
            sessions.append(gen)
        first = sessions[0].engine
        assert isinstance(first, StandardEngine) and first._layers is not None
        capacities, logits = set(), [sessions[0].logits]
        while not sessions[0].finished:
            if together:
                step_together(sessions)
            else:
                for gen in sessions:
                    gen.step()
            capacities.add(first._layers[7]._k.capacity)
            logits.append(sessions[0].logits)
        return logits, capacities

    want, grown = run(hinted=False, together=False)
    assert len(grown) > 1
    for together in (False, True):
        got, capacities = run(hinted=True, together=together)
        assert len(capacities) == 1  # allocated once
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    ids = model.tokenizer.encode(PROMPTS[0])  # a session hints its own prompt and budget
    engine = parse_engine("standard").build(model)
    GenerationSession(engine, model, DenseFfn(model), ids, 100, stop_ids=frozenset()).prefill()
    assert isinstance(engine, StandardEngine) and engine._layers is not None
    assert engine._layers[0]._k.capacity == len(ids) + 100


def test_which_prompts_may_ride_and_what_is_refused(smollm2: Model) -> None:
    model, ffn = smollm2, DenseFfn(smollm2)
    fresh = _fresh(model, PROMPTS[1])
    rest = len(fresh.prompt_ids)
    static = GenerationSession(StandardEngine(static=True), model, ffn, fresh.prompt_ids, 6)
    assert not static.takes_prompt_in_batch(rest)  # the static path prefills in one pass
    assert fresh.takes_prompt_in_batch(rest) and fresh.takes_prompt_in_batch(3)  # chunks: exact
    assert not fresh.takes_prompt_in_batch(0)
    assert advance_together([fresh], [3]) == [None]  # a chunk went in, no token yet
    assert fresh.prompt_done == 3 and fresh.engine.position == 3 and not fresh.started
    alone = _fresh(model, PROMPTS[1])
    assert advance_together([fresh], [rest]) == [alone.prefill()]  # the rest: its first token
    assert not _fresh(model, PROMPTS[1], keep_prompt_rows=True).takes_prompt_in_batch(rest)
    assert not _fresh(model, PROMPTS[1], "turbo-quant").takes_prompt_in_batch(rest)
    with pytest.raises(InvariantViolation, match="cannot take its prompt"):
        advance_together([_fresh(model, PROMPTS[1], "turbo-quant")], [rest])
    running = parse_engine("standard").build(model)
    running.prefill(model, ffn, model.tokenizer.encode(PROMPTS[0]))
    windowed = parse_engine("standard:window=8").build(model)
    with pytest.raises(InvariantViolation, match="batch_key"):
        advance_batch([running, windowed], model, ffn, [[1], [2, 3]])
    with pytest.raises(InvariantViolation, match="twice"):
        advance_batch([running, running], model, ffn, [[1], [2]])
    with pytest.raises(InvariantViolation, match="one or more tokens"):
        advance_batch([running], model, ffn, [[]])


def test_a_step_takes_what_fills_its_last_pass_of_rows(
    smollm2_default: Model, smollm2: Model
) -> None:
    """Where the block products take rows in passes, riding prompts fill the step's last pass
    (the next one where less than a quarter is left), and further whole passes where enough
    prompt tokens wait to fill them three quarters, at most `prefill_chunk` tokens; on the
    float matrices, `prefill_chunk`."""
    per_pass = rows_per_pass(smollm2_default)
    assert per_pass == (16 if cpu_extension().tiled() else 8)
    assert rows_per_pass(smollm2) is None
    limits = SchedulerLimits(prefill_chunk=32)
    blocks = Scheduler(smollm2_default, DenseFfn(smollm2_default), limits, ServerMetrics())
    floats = Scheduler(smollm2, DenseFfn(smollm2), limits, ServerMetrics())
    for decoding in (1, 7, 8, 14, 15, 16, 40):
        room = blocks._prompt_room(decoding)
        left = -decoding % per_pass
        assert room == min(32, left if 4 * left >= per_pass else left + per_pass)
        assert (decoding + room) % per_pass == 0 or room == 32
        assert floats._prompt_room(decoding) == 32
        # prompts waiting beyond the pass: whole further passes, each at least 3/4 filled
        assert blocks._prompt_room(decoding, waiting=room) == room
        more = blocks._prompt_room(decoding, waiting=room + per_pass)
        assert more == (room + per_pass if room + per_pass <= 32 else room)
        assert blocks._prompt_room(decoding, waiting=room + per_pass // 2) == room
        assert floats._prompt_room(decoding, waiting=100) == 32


def test_the_budget_benchmark_reports_each_round(smollm2_default: Model) -> None:
    """`benchmarks/batch_budget.py` (the eight-row step against the 4× budget, in
    docs/PERFORMANCE.md) runs on the default model: a line a round with its step times, ratio
    and the products' share of the budget, each derived from the numbers beside it."""
    if cpu_extension() is None:
        pytest.skip("the CPU block kernels are not built")
    path = Path(__file__).parents[1] / "benchmarks" / "batch_budget.py"
    spec = importlib.util.spec_from_file_location("batch_budget", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (line,) = module.report(smollm2_default, batch=2, rounds=1, steps=4, target=2.0)
    numbers = [float(n) for n in re.findall(r"\d+\.\d+", line)]
    fastest_1, median_1, fastest_2, median_2, ratio, products_1, products_2, share, budget = numbers
    assert 0 < fastest_1 <= median_1 and 0 < fastest_2 <= median_2
    assert ratio == pytest.approx(2 * median_1 / median_2, abs=0.02)
    assert budget == pytest.approx(median_1, abs=0.01)  # batch 2 at a 2x target: one row's step
    assert share == pytest.approx(products_2 / budget, abs=0.02)
    assert products_1 > 0
