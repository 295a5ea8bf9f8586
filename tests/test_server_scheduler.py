"""The server's scheduler and text assembly without HTTP: an engine failure ends only its own
session, timeouts, cancellation of queued and active sessions, the queue bound, and stop strings
that arrive split over several tokens."""

from __future__ import annotations

import asyncio

import pytest
import torch

from larql.inference.engine import Engine
from larql.inference.errors import BackendFailure
from larql.inference.ffn import DenseFfn, FfnBackend
from larql.inference.generation import generate
from larql.inference.sampling import SamplingParams
from larql.kv import parse_engine
from larql.kv.standard import StandardEngine
from larql.models import Model
from larql.server.metrics import ServerMetrics
from larql.server.scheduler import (
    DoneEvent,
    ErrorEvent,
    Event,
    QueueFull,
    Scheduler,
    SchedulerLimits,
    Session,
    SessionRequest,
    TokenEvent,
)
from larql.server.text import TextAssembler

PROMPT = "The capital of France is"
BOUND_S = 120  # a bound on waiting, never asserted as a timing


class FailsOnSecondStep(StandardEngine):
    """The standard engine, until its second decode step raises a backend failure."""

    name = "fails-on-second-step"

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def _step(
        self, model: Model, ffn: FfnBackend, row: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        self.steps += 1
        if self.steps == 2:
            raise BackendFailure("the disk is on fire")
        return super()._step(model, ffn, row, inputs)


def request(model: Model, n: int, spec: str = "standard", **kw) -> SessionRequest:
    ids = tuple(model.tokenizer.encode(PROMPT))
    kind = parse_engine(spec)
    return SessionRequest(ids, n, SamplingParams(), kind.spec(), kind.entry.name, **kw)


def standard(model: Model) -> Engine:
    return parse_engine("standard").build(model)


async def events_of(stream: Session) -> list[Event]:
    out: list[Event] = []
    while not out or isinstance(out[-1], TokenEvent):
        out.append(await asyncio.wait_for(stream.events.get(), BOUND_S))
    return out


def scheduler(model: Model, **limits) -> Scheduler:
    return Scheduler(model, DenseFfn(model), SchedulerLimits(**limits), ServerMetrics())


def sessions_ended(s: Scheduler, outcome: str) -> float:
    return s.metrics.registry.get_sample_value("larql_sessions_total", {"outcome": outcome}) or 0


def test_an_engine_failure_ends_only_its_session(smollm2: Model) -> None:
    async def scenario() -> tuple[list[Event], list[Event], Scheduler]:
        s = scheduler(smollm2, max_sessions=2)
        loop = asyncio.get_running_loop()
        failing = FailsOnSecondStep()
        bad = s.submit(request(smollm2, 6), failing, loop)
        good = s.submit(request(smollm2, 6), standard(smollm2), loop)
        results = await asyncio.gather(events_of(bad), events_of(good))
        s.close()
        return *results, s

    bad, good, s = asyncio.run(scenario())
    assert isinstance(bad[-1], ErrorEvent) and bad[-1].status == 500
    assert "the disk is on fire" in bad[-1].message
    assert isinstance(good[-1], DoneEvent)
    ids = smollm2.tokenizer.encode(PROMPT)
    expected = generate(standard(smollm2), smollm2, DenseFfn(smollm2), ids, 6).tokens
    assert list(good[-1].token_ids) == expected
    assert "".join(e.text for e in good if isinstance(e, TokenEvent)) == (
        smollm2.tokenizer.decode(expected)
    )
    assert sessions_ended(s, "error") == 1 and sessions_ended(s, "finished") == 1
    assert s.counts() == (0, 0)


def test_a_request_past_its_deadline_times_out(smollm2: Model) -> None:
    async def scenario() -> list[Event]:
        s = scheduler(smollm2, request_timeout_s=1e-9)
        stream = s.submit(request(smollm2, 4), standard(smollm2), asyncio.get_running_loop())
        events = await events_of(stream)
        s.close()
        return events

    events = asyncio.run(scenario())
    assert isinstance(events[-1], ErrorEvent) and events[-1].status == 408
    assert "--request-timeout" in events[-1].message


def test_queue_bound_and_cancellation(smollm2: Model) -> None:
    async def scenario() -> Scheduler:
        s = scheduler(smollm2, max_sessions=1, max_queue=1)
        loop = asyncio.get_running_loop()
        running = s.submit(request(smollm2, 64, ignore_eos=True), standard(smollm2), loop)
        waiting = s.submit(request(smollm2, 4), standard(smollm2), loop)
        with pytest.raises(QueueFull):
            s.submit(request(smollm2, 4), standard(smollm2), loop)
        assert s.counts() == (1, 1)
        s.cancel(waiting)  # a queued session leaves at once
        assert s.counts() == (1, 0) and waiting.engine is None
        await asyncio.wait_for(running.events.get(), BOUND_S)  # it is decoding
        s.cancel(running)
        for _ in range(BOUND_S * 20):
            if s.counts() == (0, 0):
                break
            await asyncio.sleep(0.05)
        s.close()
        return s

    s = asyncio.run(scenario())
    assert s.counts() == (0, 0)
    assert sessions_ended(s, "cancelled") == 2
    assert s.memory_by_engine() == {"standard": 0}


def test_stop_string_split_over_tokens_never_leaks(smollm2: Model) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode(" Paris.\n\nThe answer is: 42", add_special_tokens=False)
    text = TextAssembler(tok, ["\n\nThe"])
    pieces = [text.feed(t) for t in ids]
    assert "".join(pieces) == " Paris." == text.text
    assert text.hit_stop_string and text.flush() == ""
    assert not any("\n" in p for p in pieces)


def test_text_held_for_a_possible_stop_string_is_released(smollm2: Model) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode(" Paris.\n\nThe answer", add_special_tokens=False)
    text = TextAssembler(tok, ["\n\nThe question"])
    pieces = [text.feed(t) for t in ids]
    assert not text.hit_stop_string and text.flush() == ""
    assert "".join(pieces) == " Paris.\n\nThe answer"
    assert pieces[-1] == "\n\nThe answer"  # held while it could still become the stop string


def test_stop_tokens_are_not_text(smollm2: Model) -> None:
    tok = smollm2.tokenizer
    text = TextAssembler(tok)
    eos = min(tok.stop_ids)
    assert text.feed(tok.encode(" Paris", add_special_tokens=False)[0]) == " Paris"
    assert text.feed(eos) == "" and text.flush() == ""


def test_an_unstreamed_requests_pieces_arrive_with_its_end(smollm2: Model) -> None:
    """A streamed request gets each piece of text as its token comes; an unstreamed one gets
    the same pieces, in order, only when its generation ends (its coroutine is not woken for
    every token of every stream)."""

    async def scenario() -> tuple[list[Event], list[Event], list[int]]:
        s = scheduler(smollm2, max_sessions=2)
        loop = asyncio.get_running_loop()
        streamed = s.submit(request(smollm2, 8, ignore_eos=True), standard(smollm2), loop)
        held = s.submit(
            request(smollm2, 8, ignore_eos=True, streamed=False), standard(smollm2), loop
        )
        queued_before_end: list[int] = []
        while not held.ended:
            await asyncio.sleep(0.001)
            if not held.ended:
                queued_before_end.append(held.events.qsize())
        results = await asyncio.gather(events_of(streamed), events_of(held))
        s.close()
        return *results, queued_before_end

    streamed, held, queued_before_end = asyncio.run(scenario())
    assert queued_before_end and max(queued_before_end) == 0  # nothing handed over early
    assert isinstance(streamed[-1], DoneEvent) and isinstance(held[-1], DoneEvent)
    assert [e.text for e in held[:-1]] == [e.text for e in streamed[:-1]]  # type: ignore[union-attr]
    assert len(held) > 2 and held[-1].token_ids == streamed[-1].token_ids


def test_a_prompt_all_in_but_not_finished_is_not_picked_to_ride(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `turbo-quant` prompt whose tokens are all in while its engine still codes it (its first
    token not out yet) has nothing to put into a batched prompt step: it is not picked for one
    (it was, then left the step at once with a warning)."""
    spec = "turbo-quant:bits=3"
    s = Scheduler(smollm2, DenseFfn(smollm2), SchedulerLimits(max_sessions=2), ServerMetrics())
    monkeypatch.setattr(s, "start", lambda: None)  # the turns below are taken by hand

    async def scenario() -> tuple[Session, list[Session]]:
        loop = asyncio.get_running_loop()
        sessions = [
            s.submit(request(smollm2, 6, spec), parse_engine(spec).build(smollm2), loop)
            for _ in range(2)
        ]
        generation = s._generation(sessions[0])
        assert s.steps.prefill_part(generation, 64) is None  # the coding of its prompt waits
        return sessions[0], sessions

    coding, sessions = asyncio.run(scenario())
    assert coding.generation is not None and not coding.generation.started
    assert coding not in s._prompts_together(sessions)
