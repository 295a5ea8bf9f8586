"""The server's prefix cache: a second question about the same document starts from the cached
state and gets the tokens it would get without the cache (`standard`), sessions started from one
cached state never share it, a lossy engine answers from its cached document, prompts whose rows
are scored start afresh, and /metrics counts hits, misses and tokens saved."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import larql.server.scheduler as scheduler_module
from larql.inference.ffn import DenseFfn
from larql.inference.prefix_cache import PrefixCache
from larql.inference.sampling import SamplingParams
from larql.kv import parse_engine
from larql.models import Model
from larql.server.app import create_app
from larql.server.metrics import ServerMetrics
from larql.server.runner import serve_in_thread
from larql.server.scheduler import (
    SOLO_TURN_CHUNKS,
    DoneEvent,
    Event,
    PromptEvent,
    Scheduler,
    SchedulerLimits,
    Session,
    SessionRequest,
    TokenEvent,
)
from larql.server.settings import ServerSettings

DOC = " ".join(f"Clause {i}: the licensee keeps every notice intact." for i in range(12))
BOUND_S = 120  # a bound on waiting, never asserted as a timing


def _request(model: Model, question: str, spec: str = "standard", **kw) -> SessionRequest:
    ids = tuple(model.tokenizer.encode(DOC + "\nQuestion: " + question + "\nAnswer:"))
    kind = parse_engine(spec)
    return SessionRequest(
        ids, 6, SamplingParams(), kind.spec(), kind.entry.name, ignore_eos=True, **kw
    )


def _scheduler(model: Model, cache_bytes: int) -> Scheduler:
    cache = PrefixCache(cache_bytes, min_tokens=8)
    limits = SchedulerLimits(max_sessions=4)
    return Scheduler(model, DenseFfn(model), limits, ServerMetrics(), prefix_cache=cache)


async def _events(stream: Session) -> list[Event]:
    out: list[Event] = []
    while not out or isinstance(out[-1], TokenEvent | PromptEvent):
        out.append(await asyncio.wait_for(stream.events.get(), BOUND_S))
    return out


def _answers(model: Model, cache_bytes: int, waves: list[list[SessionRequest]]):  # type: ignore[no-untyped-def]
    """Each wave's requests submitted together, after the wave before has ended → every
    request's generated token ids, and the scheduler."""

    async def scenario() -> list[tuple[int, ...]]:
        s = _scheduler(model, cache_bytes)
        loop, out = asyncio.get_running_loop(), []
        for wave in waves:
            streams = [s.submit(r, parse_engine(r.engine_spec).build(model), loop) for r in wave]
            for events in await asyncio.gather(*(_events(x) for x in streams)):
                assert isinstance(events[-1], DoneEvent), events[-1]
                out.append(events[-1].token_ids)
        s.close()
        return out, s

    return asyncio.run(scenario())


def _sample(s: Scheduler, name: str) -> float:
    return s.metrics.registry.get_sample_value(f"larql_prefix_cache_{name}") or 0.0


def test_questions_about_one_document_share_its_state(smollm2: Model) -> None:
    first, second = _request(smollm2, "What is kept?"), _request(smollm2, "Why?")
    again = [second, second]  # two sessions from one cached state at once
    cached, s = _answers(smollm2, 2**30, [[first], [second], again])
    plain, off = _answers(smollm2, 0, [[first], [second]])
    assert cached[0] == plain[0] and cached[1] == plain[1]
    assert cached[2] == cached[3] == plain[1]  # neither changed the state the other started from
    assert _sample(s, "hits_total") == 3 and _sample(s, "misses_total") == 1
    shared = sum(1 for a, b in zip(first.prompt_ids, second.prompt_ids, strict=False) if a == b)
    assert _sample(s, "tokens_saved_total") >= 3 * (shared - 8)
    assert _sample(s, "entries") >= 1 and 0 < _sample(s, "bytes") <= 2**30
    assert off.metrics.registry.get_sample_value("larql_prefix_cache_hits_total") is None


def test_a_lossy_engine_answers_from_its_cached_document(smollm2: Model) -> None:
    spec = "turbo-quant:bits=4"
    first, second = _request(smollm2, "What is kept?", spec), _request(smollm2, "Why?", spec)
    answers, s = _answers(smollm2, 2**30, [[first], [second]])
    assert all(len(a) == 6 for a in answers)
    assert _sample(s, "hits_total") == 1


def test_an_eviction_resumes_from_a_state_along_the_document(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An eviction's state after the document cannot be cut out of the first prompt's, so the
    first prompt, taken in parts, leaves copies part-way along it; the second question resumes
    from the last before the prompts part, takes the rest as its next parts, and answers as
    a server without the cache does."""
    monkeypatch.setattr(scheduler_module, "PART_STATES_EVERY", 64)  # (its copy of the name)
    spec = "snapkv:keep=0.5,window=4"
    first, second = _request(smollm2, "What is kept?", spec), _request(smollm2, "Why?", spec)
    assert len(first.prompt_ids) > SOLO_TURN_CHUNKS * SchedulerLimits().prefill_chunk  # parts
    cached, s = _answers(smollm2, 2**30, [[first], [second]])
    plain, _ = _answers(smollm2, 0, [[first], [second]])
    assert cached == plain
    assert _sample(s, "hits_total") == 1
    assert 64 <= _sample(s, "tokens_saved_total") < len(second.prompt_ids)


def test_a_prompt_whose_rows_are_scored_starts_afresh(smollm2: Model) -> None:
    scored = _request(smollm2, "What is kept?", echo=True, logprobs=1)
    _, s = _answers(smollm2, 2**30, [[scored], [scored]])
    assert _sample(s, "hits_total") == 0 and _sample(s, "misses_total") == 0


def test_metrics_and_answers_over_http(smollm2: Model) -> None:
    body = {
        "prompt": DOC + "\nQuestion: What is kept?\nAnswer:",
        "max_tokens": 4,
        "temperature": 0,
    }
    texts = {}
    for size in (2**30, 0):
        app = create_app(smollm2, ServerSettings(prefix_cache_bytes=size))
        with serve_in_thread(app) as running:
            running.wait_started()
            for _ in range(2):
                reply = httpx.post(f"{running.url}/v1/completions", json=body, timeout=BOUND_S)
                texts.setdefault(size, []).append(reply.json()["choices"][0]["text"])
            metrics = httpx.get(f"{running.url}/metrics", timeout=BOUND_S).text
        samples = {
            s.name: s.value
            for family in text_string_to_metric_families(metrics)
            for s in family.samples
        }
        if size:
            assert samples["larql_prefix_cache_hits_total"] == 1
            assert samples["larql_prefix_cache_capacity_bytes"] == size
        else:
            assert "larql_prefix_cache_hits_total" not in samples
    assert texts[2**30] == texts[0] and texts[0][0] == texts[0][1]
