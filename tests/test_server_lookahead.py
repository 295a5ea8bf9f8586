"""The scheduler with batched steps queued a step ahead (on by default on CUDA; forced here on
the CPU over `standard`'s static path, which can take a step back): every stream gets the
events it gets with synchronous steps — tokens, text, stop strings, budgets, log-probabilities
— and steps really went ahead, one of them taken back when a stop string ended its session."""

from __future__ import annotations

import asyncio

import pytest

from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate
from larql.inference.lookahead import Lookahead
from larql.inference.sampling import SamplingParams
from larql.kv import parse_engine
from larql.kv.standard import StandardEngine
from larql.models import Model
from larql.server.metrics import ServerMetrics
from larql.server.scheduler import (
    DoneEvent,
    ErrorEvent,
    Event,
    Scheduler,
    SchedulerLimits,
    SessionRequest,
    TokenEvent,
)

PROMPTS = ["The capital of France is", "Alice put the red ball in the box, and Bob", "One two"]
BOUND_S = 120  # a bound on waiting, never asserted as a timing


def _request(model: Model, prompt: str, n: int, **kw) -> SessionRequest:
    kind = parse_engine("standard")
    ids = tuple(model.tokenizer.encode(prompt))
    return SessionRequest(ids, n, SamplingParams(), kind.spec(), kind.entry.name, **kw)


def _serve(model: Model, requests: list[SessionRequest], step_ahead: bool) -> list[list[Event]]:
    async def scenario() -> list[list[Event]]:
        limits = SchedulerLimits(max_sessions=len(requests))
        s = Scheduler(model, DenseFfn(model), limits, ServerMetrics(), step_ahead=step_ahead)
        loop = asyncio.get_running_loop()
        sessions = [s.submit(r, StandardEngine(static=True), loop) for r in requests]

        async def events_of(stream) -> list[Event]:
            out: list[Event] = []
            while not out or isinstance(out[-1], TokenEvent):
                out.append(await asyncio.wait_for(stream.events.get(), BOUND_S))
            return out

        results = await asyncio.gather(*(events_of(x) for x in sessions))
        s.close()
        assert s.counts() == (0, 0)
        return list(results)

    return asyncio.run(scenario())


def _text(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenEvent))


@pytest.mark.slow
def test_streams_a_step_ahead_get_the_events_of_synchronous_steps(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    ffn = DenseFfn(smollm2)
    ids = smollm2.tokenizer.encode(PROMPTS[1])
    free = generate(StandardEngine(static=True), smollm2, ffn, ids, 12).tokens
    text = smollm2.tokenizer.decode(free)
    stop = text[len(smollm2.tokenizer.decode(free[:5])) :][:3]  # text a few tokens in
    assert stop.strip(), "the test needs visible text to stop at"
    requests = [
        _request(smollm2, PROMPTS[0], 10, logprobs=2),
        _request(smollm2, PROMPTS[1], 12, stop_strings=(stop,)),
        _request(smollm2, PROMPTS[2], 6),
    ]
    counts = {"advance": 0, "withdrawn": 0}
    advance, withdraw = Lookahead.advance, StandardEngine.withdraw_step

    def counted_advance(self, sessions):
        counts["advance"] += 1
        return advance(self, sessions)

    def counted_withdraw(self):
        counts["withdrawn"] += 1
        return withdraw(self)

    monkeypatch.setattr(Lookahead, "advance", counted_advance)
    monkeypatch.setattr(StandardEngine, "withdraw_step", counted_withdraw)
    synchronous = _serve(smollm2, requests, step_ahead=False)
    assert counts == {"advance": 0, "withdrawn": 0}
    ahead = _serve(smollm2, requests, step_ahead=True)
    assert counts["advance"] >= 5 and counts["withdrawn"] >= 1
    for a, b in zip(ahead, synchronous, strict=True):
        done_a, done_b = a[-1], b[-1]
        assert isinstance(done_a, DoneEvent) and isinstance(done_b, DoneEvent)
        assert done_a.token_ids == done_b.token_ids
        assert done_a.finish_reason == done_b.finish_reason
        assert _text(a) == _text(b)
        entries = [e.record for e in done_a.logprobs], [e.record for e in done_b.logprobs]
        for x, y in zip(*entries, strict=True):
            assert x is not None and y is not None and x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    stopped = ahead[1][-1]
    assert isinstance(stopped, DoneEvent) and stopped.finish_reason == "stop"
    assert stop not in _text(ahead[1]) and len(stopped.token_ids) < 12
    assert [len(x[-1].token_ids) for x in (ahead[0], ahead[2])] == [10, 6]  # type: ignore[union-attr]


def _scheduler(model: Model, sessions: int) -> Scheduler:
    limits = SchedulerLimits(max_sessions=sessions)
    return Scheduler(model, DenseFfn(model), limits, ServerMetrics(), step_ahead=True)


async def _events(stream) -> list[Event]:
    out: list[Event] = []
    while not out or isinstance(out[-1], TokenEvent):
        out.append(await asyncio.wait_for(stream.events.get(), BOUND_S))
    return out


@pytest.mark.slow
def test_a_stream_cancelled_with_its_step_queued_leaves_the_others_whole(smollm2: Model) -> None:
    requests = [_request(smollm2, PROMPTS[0], 8), _request(smollm2, PROMPTS[1], 8)]
    expected = [e[-1] for e in _serve(smollm2, requests, step_ahead=False)]

    async def scenario() -> tuple[list[list[Event]], Scheduler]:
        s = _scheduler(smollm2, 3)
        loop = asyncio.get_running_loop()
        long = _request(smollm2, PROMPTS[2], 200, ignore_eos=True)
        doomed = s.submit(long, StandardEngine(static=True), loop)
        sessions = [s.submit(r, StandardEngine(static=True), loop) for r in requests]
        for _ in range(3):  # it is decoding, a step ahead with the others
            await asyncio.wait_for(doomed.events.get(), BOUND_S)
        s.cancel(doomed)
        results = await asyncio.gather(*(_events(x) for x in sessions))
        for _ in range(BOUND_S * 20):
            if s.counts() == (0, 0):
                break
            await asyncio.sleep(0.05)
        s.close()
        return list(results), s

    results, s = asyncio.run(scenario())
    for events, done in zip(results, expected, strict=True):
        assert isinstance(events[-1], DoneEvent) and isinstance(done, DoneEvent)
        assert events[-1].token_ids == done.token_ids
    assert s.counts() == (0, 0)
    ended = s.metrics.registry.get_sample_value("larql_sessions_total", {"outcome": "cancelled"})
    assert ended == 1


@pytest.mark.slow
def test_a_step_ahead_that_fails_to_launch_is_taken_alone_and_no_stream_ends(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batched static step fails once as it is queued: no engine took it (a static step
    moves no position until it succeeds), so the step queued before is read and each session
    takes this one alone; every stream gets the tokens it gets alone."""
    from larql.kv.standard.static_batch import BatchedStaticStep

    step = BatchedStaticStep.step
    calls = {"n": 0}

    def fails_once(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("the device fell over")
        return step(self, *args, **kwargs)

    monkeypatch.setattr(BatchedStaticStep, "step", fails_once)

    async def scenario() -> tuple[list[list[Event]], list[Event]]:
        s = _scheduler(smollm2, 2)
        loop = asyncio.get_running_loop()
        first = [
            s.submit(_request(smollm2, p, 8), StandardEngine(static=True), loop)
            for p in PROMPTS[:2]
        ]
        done = await asyncio.gather(*(_events(x) for x in first))
        later = s.submit(_request(smollm2, PROMPTS[2], 5), StandardEngine(static=True), loop)
        served = await _events(later)
        s.close()
        return list(done), served

    done, served = asyncio.run(scenario())
    assert calls["n"] > 3  # it failed, and batched steps went on after
    ffn = DenseFfn(smollm2)
    for prompt, events in zip(PROMPTS[:2], done, strict=True):
        ids = smollm2.tokenizer.encode(prompt)
        alone = generate(StandardEngine(static=True), smollm2, ffn, ids, 8).tokens
        assert isinstance(events[-1], DoneEvent) and list(events[-1].token_ids) == alone
    assert isinstance(served[-1], DoneEvent) and len(served[-1].token_ids) == 5


@pytest.mark.slow
def test_a_step_ahead_that_fails_when_read_ends_its_streams_only(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The long stream's last step ahead is read when it steps alone (the short one done): that
    read fails, the long stream gets the error, the finished one keeps its tokens, and the
    server serves the next request."""
    drain = Lookahead.drain
    calls = {"n": 0}

    def fails_once(self):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("the copy back failed")
        return drain(self)

    monkeypatch.setattr(Lookahead, "drain", fails_once)

    async def scenario() -> tuple[list[Event], list[Event], list[Event]]:
        s = _scheduler(smollm2, 2)
        loop = asyncio.get_running_loop()
        short = s.submit(_request(smollm2, PROMPTS[0], 3), StandardEngine(static=True), loop)
        long = s.submit(_request(smollm2, PROMPTS[1], 12), StandardEngine(static=True), loop)
        done, failed = await asyncio.gather(_events(short), _events(long))
        later = s.submit(_request(smollm2, PROMPTS[2], 4), StandardEngine(static=True), loop)
        served = await _events(later)
        s.close()
        return done, failed, served

    done, failed, served = asyncio.run(scenario())
    assert calls["n"] >= 1
    assert isinstance(done[-1], DoneEvent) and len(done[-1].token_ids) == 3
    assert isinstance(failed[-1], ErrorEvent) and "the copy back failed" in failed[-1].message
    assert isinstance(served[-1], DoneEvent) and len(served[-1].token_ids) == 4
