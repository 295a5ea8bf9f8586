"""Batched greedy decode a step ahead (`larql.inference.lookahead`): each session's tokens, its
finish and its engine's position are those of stepping it alone, also where a stop token, a
caller's stop or a budget ends a session whose next step is already queued (that step is taken
back). The default model (or its first layers); `standard`'s static path (eager on the CPU, and
through the batched attention kernel in Triton's interpreter)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import larql.kv.standard.static as static_module
from helpers import first_layers, kernel_module, model_for_kernels, relative_error
from larql.inference.engine import Engine
from larql.inference.errors import BackendUnavailable
from larql.inference.ffn import DenseFfn
from larql.inference.generation import GenerationSession
from larql.inference.lookahead import Lookahead, goes_ahead
from larql.inference.sampling import Sampler, SamplingParams
from larql.kv.captured_step import next_power_of_two
from larql.kv.standard import StandardEngine
from larql.kv.turbo_quant import TurboQuantEngine
from larql.models import Model

PROMPTS = ["The capital of France is", "Alice put the red ball in the box, and Bob", "One two"]


@pytest.fixture(scope="module")
def shallow(smollm2: Model) -> Model:
    """The default model's first 4 layers (real weights, heads and tokenizer): what goes ahead,
    is read and is taken back does not depend on the depth, and each step costs a fraction.
    Its greedy tokens repeat, so the tests that pick tokens by what the streams say (a stop
    token; streams told apart as they leave and rejoin) run the whole model."""
    return first_layers(smollm2, 4)


def _static() -> Engine:
    return StandardEngine(static=True)


def _sessions(
    model: Model,
    budgets: list[int],
    stop_ids: frozenset[int] = frozenset(),
    make: Callable[[], Engine] = _static,
) -> list[GenerationSession]:
    ffn = DenseFfn(model)
    sessions = []
    for prompt, budget in zip(PROMPTS, budgets, strict=True):
        engine = make()
        ids = model.tokenizer.encode(prompt)
        sessions.append(GenerationSession(engine, model, ffn, ids, budget, stop_ids=stop_ids))
    for session in sessions:
        session.prefill()
    return sessions


def _alone(
    model: Model,
    budgets: list[int],
    stop_ids: frozenset[int] = frozenset(),
    make: Callable[[], Engine] = _static,
):
    sessions = _sessions(model, budgets, stop_ids, make)
    for session in sessions:
        while not session.finished:
            session.step()
    return sessions


def _ahead(sessions: list[GenerationSession]) -> list[tuple[GenerationSession, int]]:
    lookahead = Lookahead()
    read = []
    while any(not s.finished for s in sessions):
        read += lookahead.advance(sessions)
    return read + lookahead.drain()


def _same_as_alone(ahead: list[GenerationSession], alone: list[GenerationSession]) -> None:
    for a, b in zip(ahead, alone, strict=True):
        assert a.tokens == b.tokens
        assert a.finish_reason == b.finish_reason
        assert a.engine.position == b.engine.position


@pytest.mark.slow
def test_sessions_a_step_ahead_get_their_tokens_alone(shallow: Model) -> None:
    budgets = [7, 4, 9]  # each ends at its own step; no step is launched past a budget
    alone = _alone(shallow, budgets)
    sessions = _sessions(shallow, budgets)
    read = _ahead(sessions)
    _same_as_alone(sessions, alone)
    assert len({tuple(s.tokens) for s in sessions}) == len(PROMPTS)
    assert [token for session, token in read if session is sessions[0]] == sessions[0].tokens[1:]
    for a, b in zip(sessions, alone, strict=True):
        assert a.logits is not None and b.logits is not None
        assert torch.allclose(a.logits, b.logits, atol=1e-3, rtol=0)


@pytest.mark.slow
def test_a_stop_token_takes_back_the_step_queued_after_it(smollm2: Model) -> None:
    """A token one session picks a few steps in (and no session picks earlier) is made a
    stop: its next step was queued before the stop was read, and is taken back (its engine
    ends where it ends alone)."""
    free = _alone(smollm2, [10, 10, 10])
    others = set(free[1].tokens) | set(free[2].tokens)
    tokens = free[0].tokens
    at = next(i for i in range(2, 9) if tokens[i] not in others and tokens[i] not in tokens[:i])
    stop = frozenset({tokens[at]})
    alone = _alone(smollm2, [10, 10, 10], stop)
    assert alone[0].finish_reason == "stop" and len(alone[0].tokens) == at + 1
    assert alone[1].finish_reason == "length"
    sessions = _sessions(smollm2, [10, 10, 10], stop)
    _ahead(sessions)
    _same_as_alone(sessions, alone)


@pytest.mark.slow
def test_a_session_the_caller_stops_loses_its_queued_step(shallow: Model) -> None:
    alone = _sessions(shallow, [10, 10, 10])
    for session in alone:
        for _ in range(3):
            session.step()
    alone[1].stop()
    sessions = _sessions(shallow, [10, 10, 10])
    lookahead = Lookahead()
    for _ in range(4):  # three steps read, the fourth queued
        lookahead.advance(sessions)
    sessions[1].stop()
    lookahead.withdraw(sessions[1])
    assert sessions[1] not in lookahead.in_flight
    lookahead.drain()
    assert sessions[1].tokens == alone[1].tokens
    assert sessions[1].engine.position == alone[1].engine.position
    assert sessions[0].tokens[:4] == alone[0].tokens and len(sessions[0].tokens) == 5


@pytest.mark.slow
def test_sessions_may_leave_and_rejoin_a_step_ahead(smollm2: Model) -> None:
    """Groups that change between steps: a session left out is read from the queued step, one
    rejoining takes its last token from the host."""
    alone = _alone(smollm2, [6, 6, 6])
    sessions = _sessions(smollm2, [6, 6, 6])
    lookahead = Lookahead()
    lookahead.advance(sessions)
    lookahead.advance(sessions[:2])
    lookahead.advance([sessions[2], sessions[0]])
    while any(not s.finished for s in sessions):
        lookahead.advance(sessions)
    lookahead.drain()
    _same_as_alone(sessions, alone)


@pytest.mark.slow
def test_through_the_batched_attention_kernel(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel path reads positions from a device table the step ahead moves on in place;
    caches first allocated just above their prompts grow while steps are queued."""
    kernel_module("larql.kernels.batched_decode_attention")
    model = model_for_kernels(smollm2, monkeypatch, interpreted_layers=2)
    monkeypatch.setattr(static_module, "initial_capacity", lambda n: next_power_of_two(n + 1))
    alone = _alone(model, [5, 3, 5])
    sessions = _sessions(model, [5, 3, 5])
    capacities = [s.engine.fast_path.capacity for s in sessions if s.engine.fast_path]
    _ahead(sessions)
    _same_as_alone(sessions, alone)
    grown = [s.engine.fast_path.capacity for s in sessions if s.engine.fast_path]
    assert any(after > before for after, before in zip(grown, capacities, strict=True))


@pytest.mark.slow
def test_turbo_quant_on_its_kernels_takes_a_step_back(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """turbo-quant's kernel path goes ahead and takes a step back: its 3 newest rows exact, so
    the step taken back has coded the row leaving the ring and written its own into the ring.
    The stopped session holds the rows it holds alone and, stepped on, steps as alone."""
    kernel_module("larql.kv.turbo_quant.kernels")
    model = model_for_kernels(smollm2, monkeypatch, interpreted_layers=1)

    def make() -> Engine:
        return TurboQuantEngine(recent=3, sinks=2, center=True)

    alone = _sessions(model, [10, 10, 10], make=make)
    for session in alone:
        for _ in range(4):
            session.step()
    sessions = _sessions(model, [10, 10, 10], make=make)
    assert all(s.engine.dispatch_path() is not None for s in sessions)  # the kernel path
    assert goes_ahead(sessions)
    lookahead = Lookahead()
    for _ in range(5):  # four steps read, the fifth queued
        lookahead.advance(sessions)
    sessions[1].stop()
    lookahead.withdraw(sessions[1])
    lookahead.drain()
    stopped, by_itself = sessions[1], alone[1]
    assert stopped.tokens == by_itself.tokens
    assert stopped.engine.position == by_itself.engine.position
    assert isinstance(stopped.engine, TurboQuantEngine)
    assert isinstance(by_itself.engine, TurboQuantEngine)
    assert stopped.engine.stored_rows(0) == by_itself.engine.stored_rows(0)
    ffn = DenseFfn(model)
    with torch.inference_mode():
        for token in stopped.tokens[:4]:  # past the ring: every slot taken back written anew
            mine = stopped.engine.decode_step(model, ffn, token)
            theirs = by_itself.engine.decode_step(model, ffn, token)
            assert relative_error(mine, theirs) <= 1e-3


def test_only_greedy_sessions_of_engines_that_take_steps_back_go_ahead(smollm2: Model) -> None:
    ffn = DenseFfn(smollm2)
    ids = smollm2.tokenizer.encode(PROMPTS[0])

    def session(engine: StandardEngine, sampler: Sampler | None = None) -> GenerationSession:
        made = GenerationSession(engine, smollm2, ffn, ids, 4, sampler=sampler)
        made.prefill()
        return made

    static = [session(StandardEngine(static=True)) for _ in range(2)]
    assert goes_ahead(static)
    eager = [session(StandardEngine()) for _ in range(2)]
    assert not eager[0].engine.withdraws_steps() and not goes_ahead(eager)
    with pytest.raises(BackendUnavailable):
        eager[0].engine.withdraw_step()
    sampled = session(StandardEngine(static=True), Sampler(SamplingParams(temperature=0.8)))
    assert not goes_ahead([static[0], sampled])
    assert not goes_ahead([])
