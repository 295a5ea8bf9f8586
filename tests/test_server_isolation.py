"""One session's failure inside a batched step ends that session only: eight greedy streams share
their decode steps, one of them fails (its own attention raises; its engine's state goes wrong;
a part every session shares fails once), and the other streams get exactly the tokens they get
alone. On the CPU always, on CUDA where there is one (the eager path; the position check also on
the static graph path with steps queued ahead)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
import torch

from larql.inference.engine import Engine
from larql.inference.errors import BackendFailure
from larql.inference.ffn import DenseFfn
from larql.inference.generation import SessionsFailed, generate
from larql.inference.sampling import SamplingParams
from larql.kv.buffers import KvBuffer
from larql.kv.standard import StandardEngine
from larql.models import Model, load_model
from larql.server import steps as steps_module
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

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "The quick brown fox",
    "In the beginning",
    "Water boils at",
    "The largest planet is",
    "My favourite food is",
    "The answer to the question",
]
NEW_TOKENS = 8
FAILING = 3  # the index of the session that fails
BOUND_S = 300  # a bound on waiting, never asserted as a timing

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


@pytest.fixture(scope="module")
def cuda_model() -> Model:
    return load_model("smollm2-135m", dtype=torch.float32, weights="float", device="cuda")


@pytest.fixture(params=DEVICES)
def model(request: pytest.FixtureRequest) -> Model:
    """The default model in float32 (float weights) on each device."""
    if request.param == "cuda":
        return request.getfixturevalue("cuda_model")
    return request.getfixturevalue("smollm2")


def _same_batch(engine: StandardEngine, key: object) -> object:
    """A plain `standard` engine's key for `key` (the test engines batch with them)."""
    return None if key is None else (StandardEngine, *key[1:])  # type: ignore[index]


class RaisingRows(KvBuffer):
    """One layer's K/V that raises on its `fail_at`-th append (the prompt's is the first)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.appends, self.fail_at = 0, fail_at

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.appends += 1
        if self.appends == self.fail_at:
            raise BackendFailure("injected: this stream's own attention failed")
        return super().append(k, v)


class FailsInItsOwnPart(StandardEngine):
    """An eager `standard` engine whose attention on layer 5 raises at its `step`-th decode
    step (its own part of a batched step); it batches with plain `standard` engines."""

    def __init__(self, step: int) -> None:
        super().__init__(graph=False)
        self.step = step

    def batch_key(self):  # type: ignore[no-untyped-def]
        return _same_batch(self, super().batch_key())

    def prompt_batch_key(self, model: Model):  # type: ignore[no-untyped-def]
        return _same_batch(self, super().prompt_batch_key(model))

    def _new_buffer(self, model: Model, layer: int):  # type: ignore[no-untyped-def]
        return RaisingRows(self.step + 1) if layer == 5 else super()._new_buffer(model, layer)


class LosesItsPlace(StandardEngine):
    """A `standard` engine whose position goes wrong at its `step`-th batched decode step (the
    state no longer says where its tokens are); it batches with plain `standard` engines."""

    def __init__(self, step: int, graph: bool) -> None:
        super().__init__(graph=graph)
        self.step, self.steps = step, 0

    def batch_key(self):  # type: ignore[no-untyped-def]
        return _same_batch(self, super().batch_key())

    def prompt_batch_key(self, model: Model):  # type: ignore[no-untyped-def]
        return _same_batch(self, super().prompt_batch_key(model))

    def _require_prefill(self) -> None:  # every batched decode step asks this of each engine
        super()._require_prefill()
        self.steps += 1
        if self.steps == self.step:
            self.position -= 2


class FailsOnceInABatch(DenseFfn):
    """The dense FFN, failing once in the `when`-th call over a batched step's 8 rows: a part
    every session shares."""

    def __init__(self, model: Model, when: int) -> None:
        super().__init__(model)
        self.calls, self.when = 0, when

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == len(PROMPTS):  # (a step's rows; one row may take `fused_block`)
            self.calls += 1
            if self.calls == self.when:
                raise RuntimeError("injected: the shared FFN failed once")
        return super().forward(layer, x)


def _request(model: Model, prompt: str) -> SessionRequest:
    ids = tuple(model.tokenizer.encode(prompt))
    return SessionRequest(
        ids, NEW_TOKENS, SamplingParams(), "standard", "standard", ignore_eos=True
    )


_ALONE: dict[tuple[str, str, bool], list[int]] = {}


def _alone(model: Model, prompt: str, graph: bool = False) -> list[int]:
    """The prompt's tokens generated alone (once per device and path)."""
    key = (model.device.type, prompt, graph)
    if key not in _ALONE:
        engine, ids = StandardEngine(graph=graph), model.tokenizer.encode(prompt)
        ffn = DenseFfn(model)
        _ALONE[key] = generate(engine, model, ffn, ids, NEW_TOKENS, stop_ids=frozenset()).tokens
    return _ALONE[key]


async def _events(stream) -> list[Event]:  # type: ignore[no-untyped-def]
    out: list[Event] = []
    while not out or isinstance(out[-1], TokenEvent):
        out.append(await asyncio.wait_for(stream.events.get(), BOUND_S))
    return out


def _serve(
    model: Model, engines: list[Engine], ffn: DenseFfn | None = None
) -> tuple[list[list[Event]], Scheduler]:
    """The eight prompts as eight sessions of one scheduler, each through its engine."""
    limits = SchedulerLimits(max_sessions=len(PROMPTS))
    s = Scheduler(model, ffn or DenseFfn(model), limits, ServerMetrics())

    async def scenario() -> list[list[Event]]:
        loop = asyncio.get_running_loop()
        sessions = [
            s.submit(_request(model, p), e, loop) for p, e in zip(PROMPTS, engines, strict=True)
        ]
        results = await asyncio.gather(*(_events(x) for x in sessions))
        s.close()
        return list(results)

    return asyncio.run(scenario()), s


@pytest.fixture
def batch_sizes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, bool]]]:
    """Each batched decode step's session count, and whether some session failed in it."""
    sizes: list[tuple[int, bool]] = []
    real = steps_module.step_together

    def recording(sessions):  # type: ignore[no-untyped-def]
        try:
            tokens = real(sessions)
        except SessionsFailed:
            sizes.append((len(sessions), True))
            raise
        sizes.append((len(sessions), False))
        return tokens

    monkeypatch.setattr(steps_module, "step_together", recording)
    yield sizes


def _check_the_others(
    model: Model,
    results: list[list[Event]],
    failed: Callable[[list[Event]], None],
    graph: bool = False,
) -> None:
    for i, (prompt, events) in enumerate(zip(PROMPTS, results, strict=True)):
        if i == FAILING:
            failed(events)
            continue
        assert isinstance(events[-1], DoneEvent), (prompt, events[-1])
        assert list(events[-1].token_ids) == _alone(model, prompt, graph), prompt


def _sessions_ended(s: Scheduler, outcome: str) -> float:
    sample = s.metrics.registry.get_sample_value("larql_sessions_total", {"outcome": outcome})
    return sample or 0


@pytest.mark.slow
def test_a_session_whose_own_part_raises_leaves_the_batch_alone(
    model: Model, batch_sizes: list[tuple[int, bool]]
) -> None:
    engines: list[Engine] = [StandardEngine(graph=False) for _ in PROMPTS]
    engines[FAILING] = FailsInItsOwnPart(step=5)
    results, s = _serve(model, engines)

    def failed(events: list[Event]) -> None:
        assert isinstance(events[-1], ErrorEvent) and events[-1].status == 500
        assert "this stream's own attention failed" in events[-1].message
        assert len([e for e in events if isinstance(e, TokenEvent)]) < NEW_TOKENS

    _check_the_others(model, results, failed)
    assert (len(PROMPTS), True) in batch_sizes  # it failed inside a step of all eight
    assert _sessions_ended(s, "error") == 1 and _sessions_ended(s, "finished") == 7


@pytest.mark.slow
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_session_whose_state_goes_wrong_leaves_before_the_next_step(
    model: Model, graph: bool
) -> None:
    if graph and model.device.type != "cuda":
        pytest.skip("the static graph path runs on CUDA")
    engines: list[Engine] = [StandardEngine(graph=graph) for _ in PROMPTS]
    engines[FAILING] = LosesItsPlace(step=3, graph=graph)
    results, s = _serve(model, engines)

    def failed(events: list[Event]) -> None:
        assert isinstance(events[-1], ErrorEvent) and events[-1].status == 500
        assert "its engine is at position" in events[-1].message

    _check_the_others(model, results, failed, graph)
    assert _sessions_ended(s, "error") == 1 and _sessions_ended(s, "finished") == 7


@pytest.mark.slow
def test_a_shared_part_failing_once_costs_no_stream_its_tokens(
    model: Model, batch_sizes: list[tuple[int, bool]]
) -> None:
    """The FFN fails once in a step of all eight: every engine is cut back to its state
    before the step, each session takes it alone, and every stream still gets its tokens."""
    ffn = FailsOnceInABatch(model, when=40)  # the tenth layer of the second all-eight step
    engines: list[Engine] = [StandardEngine(graph=False) for _ in PROMPTS]
    results, s = _serve(model, engines, ffn)
    assert ffn.calls >= ffn.when  # it did fail
    for prompt, events in zip(PROMPTS, results, strict=True):
        assert isinstance(events[-1], DoneEvent), (prompt, events[-1])
        assert list(events[-1].token_ids) == _alone(model, prompt), prompt
    assert _sessions_ended(s, "finished") == len(PROMPTS)


class FailsToSayItsBatch(StandardEngine):
    """A `standard` engine whose `batch_key` raises once its prompt is in: a bug the scheduler
    meets while picking a step, outside every session's own guarded part."""

    def batch_key(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("injected: the engine cannot say which batch it joins")


def test_a_turn_that_fails_outside_any_session_ends_its_sessions_not_the_server(
    smollm2: Model, caplog: pytest.LogCaptureFixture
) -> None:
    """One session active, one queued behind it: picking the first one's decode step raises,
    that session ends with a 500 error, and the scheduler goes on to serve the queued one
    exactly (before, the scheduler thread died there and every stream waited forever)."""
    limits = SchedulerLimits(max_sessions=1, max_queue=1)
    s = Scheduler(smollm2, DenseFfn(smollm2), limits, ServerMetrics())
    prompts = PROMPTS[:2]

    async def scenario() -> list[list[Event]]:
        loop = asyncio.get_running_loop()
        engines = [FailsToSayItsBatch(graph=False), StandardEngine(graph=False)]
        sessions = [
            s.submit(_request(smollm2, p), e, loop) for p, e in zip(prompts, engines, strict=True)
        ]
        results = await asyncio.gather(*(_events(x) for x in sessions))
        s.close()
        return list(results)

    broken, served = asyncio.run(scenario())
    assert isinstance(broken[-1], ErrorEvent) and broken[-1].status == 500
    assert "cannot say which batch it joins" in broken[-1].message
    assert isinstance(served[-1], DoneEvent)
    assert list(served[-1].token_ids) == _alone(smollm2, prompts[1])
    assert "a scheduler turn failed" in caplog.text
    assert _sessions_ended(s, "error") == 1 and _sessions_ended(s, "finished") == 1
