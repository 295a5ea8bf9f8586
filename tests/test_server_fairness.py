"""No request holds the scheduler for more than a part of its work: a prompt scored with echo +
logprobs goes in `prefill_chunk` tokens a turn with a running stream's steps between, a
`no-cache` step that re-runs the whole context goes in parts the same way, and cancellation, a
deadline and shutdown each take effect after the part under way. Over HTTP: a request is parsed
and tokenized off the event loop, and a chunked body over the limit is refused (413) without
being read."""

from __future__ import annotations

import asyncio
import json
import select
import socket
from collections.abc import Callable
from dataclasses import replace

import httpx
import pytest
import torch

from helpers import first_layers
from larql.inference.ffn import DenseFfn
from larql.inference.generation import GenerationSession, generate, teacher_forced_logits
from larql.inference.sampling import SamplingParams
from larql.kv import parse_engine
from larql.models import Model
from larql.server import app as app_module
from larql.server.app import create_app
from larql.server.metrics import ServerMetrics
from larql.server.runner import serve_in_thread
from larql.server.scheduler import (
    DoneEvent,
    ErrorEvent,
    Event,
    PromptEvent,
    Scheduler,
    SchedulerClosed,
    SchedulerLimits,
    Session,
    SessionRequest,
    TokenEvent,
)
from larql.server.settings import ServerSettings

STREAM = "The capital of France is"
LONG = "The quick brown fox jumps over the lazy dog. " * 4  # 41 tokens
CHUNK = 8
BOUND_S = 300  # a bound on waiting, never asserted as a timing


def _request(model: Model, text: str, n: int, spec: str = "standard", **kw) -> SessionRequest:  # type: ignore[no-untyped-def]
    kind = parse_engine(spec)
    ids = tuple(model.tokenizer.encode(text))
    return SessionRequest(ids, n, SamplingParams(), kind.spec(), kind.entry.name, **kw)


async def _events(arrival: Session) -> list[Event]:
    out: list[Event] = []
    while not out or isinstance(out[-1], TokenEvent | PromptEvent):
        out.append(await asyncio.wait_for(arrival.events.get(), BOUND_S))
    return out


def _beside_a_stream(
    model: Model,
    second: SessionRequest,
    on_submit: Callable[[Scheduler, Session], None] | None = None,
) -> tuple[list[Event], Session, Scheduler]:
    """A 40-token `standard` stream decodes; then `second` arrives (`prefill_chunk` 8) →
    the stream's events, once it ended, and the second stream (its events in its queue)."""
    stream = _request(model, STREAM, 40, ignore_eos=True)

    async def scenario() -> tuple[list[Event], Session, Scheduler]:
        limits = SchedulerLimits(max_sessions=2, prefill_chunk=CHUNK)
        s = Scheduler(model, DenseFfn(model), limits, ServerMetrics())
        loop = asyncio.get_running_loop()
        first = s.submit(stream, parse_engine("standard").build(model), loop)
        await asyncio.wait_for(first.events.get(), BOUND_S)  # it is decoding
        other = s.submit(second, parse_engine(second.engine_spec).build(model), loop)
        if on_submit is not None:
            on_submit(s, other)
        events = await _events(first)
        while not other.ended:
            await asyncio.sleep(0.01)
        s.close()
        return events, other, s

    return asyncio.run(scenario())


def _drained(arrival: Session) -> list[Event]:
    """What the stream's queue holds."""
    out: list[Event] = []
    while not arrival.events.empty():
        out.append(arrival.events.get_nowait())
    return out


@pytest.fixture(scope="module")
def model(smollm2: Model) -> Model:
    """The real model's first two layers: the turns a scheduler gives are the same at any
    depth, and every stream here is checked against the same model's run alone."""
    return first_layers(smollm2, 2)


@pytest.fixture
def turns(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    """Each turn's work, in order: (engine, "prompt" / "step", prompt tokens or step rows)."""
    seen: list[tuple[str, str, int]] = []
    feed, step_part = GenerationSession.feed_prompt, GenerationSession.step_part

    def recording_feed(self: GenerationSession, max_tokens: int) -> torch.Tensor | None:
        seen.append((self.engine.name, "prompt", max_tokens))
        return feed(self, max_tokens)

    def recording_step(self: GenerationSession, max_rows: int) -> int | None:
        seen.append((self.engine.name, "step", max_rows))
        return step_part(self, max_rows)

    monkeypatch.setattr(GenerationSession, "feed_prompt", recording_feed)
    monkeypatch.setattr(GenerationSession, "step_part", recording_step)
    return seen


def _alternate(seen: list[tuple[str, str, int]], engine: str) -> list[tuple[str, str, int]]:
    """`engine`'s turns, each checked to be followed by a turn of the stream's."""
    mine = [i for i, (name, _, _) in enumerate(seen) if name == engine]
    for i in mine[:-1]:
        assert seen[i + 1][0] == "standard", seen[i : i + 2]
    return [seen[i] for i in mine]


def _stream_alone(model: Model) -> list[int]:
    engine = parse_engine("standard").build(model)
    ids = model.tokenizer.encode(STREAM)
    return generate(engine, model, DenseFfn(model), ids, 40, stop_ids=frozenset()).tokens


@pytest.mark.slow
def test_scoring_a_prompt_goes_in_parts_between_a_streams_steps(
    model: Model, turns: list[tuple[str, str, int]]
) -> None:
    """echo + logprobs with max_tokens 0 through no-cache: its 41 prompt tokens go in 8 a
    turn, the stream stepping between them, and every prompt token is scored as the whole
    prompt's one pass scores it."""
    scored = _request(model, LONG, 0, "no-cache", echo=True, logprobs=2)
    stream, arrival, _ = _beside_a_stream(model, scored)
    other = _drained(arrival)
    parts = -(-len(scored.prompt_ids) // CHUNK)
    assert [kind for _, kind, _ in _alternate(turns, "no-cache")] == ["prompt"] * parts
    assert isinstance(other[0], PromptEvent) and isinstance(other[-1], DoneEvent)
    ids = list(scored.prompt_ids)
    whole = teacher_forced_logits(
        parse_engine("no-cache").build(model), model, DenseFfn(model), ids, len(ids), True
    )  # [S, V]: row i predicts ids[i + 1]
    expected = torch.log_softmax(whole[:-1].double(), -1).gather(1, torch.tensor(ids[1:])[:, None])
    served = torch.tensor([r.logprob for r in other[0].logprobs], dtype=torch.float64)
    assert len(served) == len(ids) - 1 and all(len(r.top) == 2 for r in other[0].logprobs)
    assert (served - expected.squeeze(1)).abs().max().item() <= 1e-4  # float32, other shapes
    assert isinstance(stream[-1], DoneEvent) and list(stream[-1].token_ids) == _stream_alone(model)


@pytest.mark.slow
def test_a_step_that_reruns_the_context_goes_in_parts(
    model: Model, turns: list[tuple[str, str, int]]
) -> None:
    """no-cache after a 41-token prompt: each of its steps re-runs 42+ positions, 8 a turn,
    with the stream's steps between; its tokens are the ones it generates alone."""
    request = _request(model, LONG, 3, "no-cache", ignore_eos=True)
    stream, arrival, _ = _beside_a_stream(model, request)
    other = _drained(arrival)
    steps = [rows for _, kind, rows in _alternate(turns, "no-cache") if kind == "step"]
    per_step = -(-(len(request.prompt_ids) + 1) // CHUNK)
    assert len(steps) >= 2 * per_step and set(steps) == {CHUNK}  # 2 steps, 8 rows a part
    engine = parse_engine("no-cache").build(model)
    ids = list(request.prompt_ids)
    alone = generate(engine, model, DenseFfn(model), ids, 3, stop_ids=frozenset()).tokens
    assert isinstance(other[-1], DoneEvent) and list(other[-1].token_ids) == alone
    assert isinstance(stream[-1], DoneEvent) and list(stream[-1].token_ids) == _stream_alone(model)


def _stopped_after_two_parts(
    model: Model, stop: Callable[[Scheduler, Session], None]
) -> tuple[list[Event], Scheduler]:
    """A no-cache prompt scored beside a stream; `stop` acts on it after its second part."""
    request = _request(model, LONG, 0, "no-cache", echo=True, logprobs=0)
    held: list[tuple[Scheduler, Session]] = []
    feed = GenerationSession.feed_prompt  # (the `turns` fixture's, recording)

    def after_two(self: GenerationSession, max_tokens: int) -> torch.Tensor | None:
        out = feed(self, max_tokens)
        if self.engine.name == "no-cache" and self.prompt_done == 2 * CHUNK:
            stop(*held[0])
        return out

    GenerationSession.feed_prompt = after_two  # type: ignore[method-assign]
    try:
        _, arrival, s = _beside_a_stream(model, request, lambda s, x: held.append((s, x)))
    finally:
        GenerationSession.feed_prompt = feed  # type: ignore[method-assign]
    return _drained(arrival), s


@pytest.mark.slow
@pytest.mark.parametrize("how", ["cancel", "deadline", "shutdown"])
def test_cancel_deadline_and_shutdown_take_effect_after_the_part_under_way(
    model: Model, turns: list[tuple[str, str, int]], how: str
) -> None:
    def stop(s: Scheduler, arrival: Session) -> None:
        if how == "cancel":
            s.cancel(arrival)
        elif how == "deadline":
            arrival.deadline = 0.0
        else:
            s.begin_shutdown(0.0)

    other, s = _stopped_after_two_parts(model, stop)
    assert len([t for t in turns if t[0] == "no-cache"]) == 2  # none after the one under way
    status = {"cancel": None, "deadline": 408, "shutdown": 503}[how]
    if status is None:
        assert other == []  # nobody is listening
    else:
        assert isinstance(other[-1], ErrorEvent) and other[-1].status == status
    outcome = {"cancel": "cancelled", "deadline": "timeout", "shutdown": "shutdown"}[how]
    assert s.metrics.registry.get_sample_value("larql_sessions_total", {"outcome": outcome})


def test_shutdown_lets_a_running_stream_finish_within_its_grace(model: Model) -> None:
    """Once shutdown begins, new sessions are refused at once and a running one goes on to its
    end while the grace lasts."""

    async def scenario() -> list[Event]:
        limits = SchedulerLimits(max_sessions=1, shutdown_timeout_s=BOUND_S)
        s = Scheduler(model, DenseFfn(model), limits, ServerMetrics())
        loop = asyncio.get_running_loop()
        running = s.submit(_request(model, STREAM, 12, ignore_eos=True), _standard(model), loop)
        queued = s.submit(_request(model, STREAM, 2), _standard(model), loop)
        await asyncio.wait_for(running.events.get(), BOUND_S)  # it is decoding
        s.begin_shutdown()
        queued_events = await _events(queued)
        assert isinstance(queued_events[-1], ErrorEvent) and queued_events[-1].status == 503
        with pytest.raises(SchedulerClosed):
            s.submit(_request(model, STREAM, 2), _standard(model), loop)
        events = await _events(running)
        s.close()
        return events

    events = asyncio.run(scenario())
    assert isinstance(events[-1], DoneEvent) and len(events[-1].token_ids) == 12


def _standard(model: Model):  # type: ignore[no-untyped-def]
    return parse_engine("standard").build(model)


# ---------------------------------------------------------------------------- over HTTP


def test_requests_are_parsed_and_tokenized_off_the_event_loop(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    where: list[bool] = []  # per request: whether an event loop ran in the preparing thread
    real = app_module.prepare_completion

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            asyncio.get_running_loop()
            where.append(True)
        except RuntimeError:
            where.append(False)
        return real(*args, **kwargs)

    monkeypatch.setattr(app_module, "prepare_completion", recording)
    with serve_in_thread(create_app(smollm2, ServerSettings())) as running:
        running.wait_started(BOUND_S)
        body = {"prompt": STREAM, "max_tokens": 2, "temperature": 0}
        response = httpx.post(f"{running.url}/v1/completions", json=body, timeout=BOUND_S)
        bad = httpx.post(f"{running.url}/v1/completions", content=b'{"prompt": ', timeout=BOUND_S)
    assert response.status_code == 200 and where == [False]
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]


def test_a_text_too_long_to_fit_is_refused_untokenized(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt with more characters than `--max-prompt-tokens` tokens of the model's longest
    token can hold is a 400 before anything tokenizes it; one character less goes on."""
    prepared: list[int] = []
    real = app_module.prepare_completion

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        prepared.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(app_module, "prepare_completion", counting)
    settings = replace(ServerSettings(), max_prompt_tokens=64)
    longest = max(map(len, smollm2.tokenizer.tokenizer.get_vocab(with_added_tokens=True)))
    with serve_in_thread(create_app(smollm2, settings)) as running:
        running.wait_started(BOUND_S)
        url = f"{running.url}/v1/completions"
        body = {"prompt": "a" * (64 * longest + 1), "max_tokens": 1}
        refused = httpx.post(url, json=body, timeout=BOUND_S)
        assert prepared == []
        body["prompt"] = "a" * (64 * longest)
        tokenized = httpx.post(url, json=body, timeout=BOUND_S)
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "prompt"
    assert error["code"] == "context_length_exceeded" and "tokenizes at most" in error["message"]
    assert prepared == [1] and tokenized.status_code == 400  # tokenized: too many tokens
    assert "--max-prompt-tokens" in tokenized.json()["error"]["message"]


def _whole(answer: bytes) -> bool:
    """Whether an HTTP answer's head and its Content-Length of body are all there."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    lengths = [
        line.split(b":", 1)[1]
        for line in head.lower().split(b"\r\n")[1:]
        if line.startswith(b"content-length:")
    ]
    return bool(lengths) and len(body) >= int(lengths[0])


def test_a_chunked_body_over_the_limit_is_refused_unread(smollm2: Model) -> None:
    """A chunked body (no Content-Length) over `max_body_bytes`: a 413 as soon as the bytes
    read pass the limit, while the client is still sending (it sent far less than it meant)."""
    limit, piece, meant = 4096, 64 * 1024, 64 * 2**20
    settings = replace(ServerSettings(), max_body_bytes=limit)
    with serve_in_thread(create_app(smollm2, settings)) as running:
        running.wait_started(BOUND_S)
        host, port = running.url.removeprefix("http://").split(":")
        sent, answer = 0, b""
        with socket.create_connection((host, int(port)), timeout=BOUND_S) as sock:
            head = (
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Transfer-Encoding: chunked\r\n\r\n"
            )
            sock.sendall(head.encode())
            while sent < meant and not answer:
                try:
                    sock.sendall(f"{piece:x}\r\n".encode() + b" " * piece + b"\r\n")
                except OSError:  # the server closed the connection after answering
                    break
                sent += piece
                if select.select([sock], [], [], 0.05)[0]:
                    answer = sock.recv(65536)
            while not _whole(answer) and select.select([sock], [], [], BOUND_S)[0]:
                more = sock.recv(65536)
                if not more:
                    break
                answer += more
    head, _, body_bytes = answer.partition(b"\r\n\r\n")
    assert b" 413 " in head.split(b"\r\n", 1)[0], answer[:200]
    body = json.loads(body_bytes)
    assert f"the limit is {limit}" in body["error"]["message"]
    assert sent < 4 * 2**20  # the rest was never sent: the server stopped reading
