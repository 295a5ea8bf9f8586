"""`larql serve` as clients see it: a real server process on 127.0.0.1 (ephemeral port) driven by
the official `openai` client and by raw HTTP — completions and chat, streamed and whole, the same
tokens as `larql run`'s generation loop, per-request engines kept apart under concurrency,
cancellation, the bad-input matrix, 429 behind a full queue, metrics in the Prometheus format.

A second server (in this process, on a thread) has tight limits: one session, a queue of one, a
16-token prompt limit, a 4 kB body limit, and a model copy without a chat template."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from larql.cli.app import app
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate
from larql.inference.sampling import Sampler, SamplingParams
from larql.kv import parse_engine, supported_names
from larql.kv.resolve import ENV_VAR
from larql.models import Model
from larql.server import runner
from larql.server.app import create_app
from larql.server.runner import serve_in_thread
from larql.server.settings import ServerSettings

PROMPT = "The capital of France is"
MODEL = "smollm2-135m"
STARTUP_S = 180  # bounds on waiting, never asserted as timings
SETTLE_S = 60
# the cores this test process may use (conftest shares them among pytest-xdist's workers): a
# server with more threads than its share spins OpenMP workers against the other workers' tests
THREADS = os.environ.get("OMP_NUM_THREADS", "1")


# ---------------------------------------------------------------------------- servers


class ServerProcess:
    def __init__(self, *args: str) -> None:
        larql = Path(sys.executable).with_name("larql")
        env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
        self.proc = subprocess.Popen(
            [str(larql), "serve", "--port", "0", *args],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.log: list[str] = []
        lines: queue.Queue[str] = queue.Queue()

        def drain() -> None:  # keeps the pipe empty for the server's whole life
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.append(line)
                lines.put(line)
            lines.put("")

        threading.Thread(target=drain, daemon=True).start()
        self.url = self._wait_for_url(lines)
        wait_until(lambda: httpx.get(f"{self.url}/health").status_code == 200, STARTUP_S)

    def _wait_for_url(self, lines: queue.Queue[str]) -> str:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            line = lines.get(timeout=STARTUP_S)
            if not line:
                break
            if " on http://" in line:
                return line.split(" on ", 1)[1].split()[0]
        raise RuntimeError("server did not start:\n" + "".join(self.log))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def wait_until(condition: Callable[[], bool], bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while True:
        try:
            if condition():
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {bound_s} s")
        time.sleep(0.05)


# each running server's stderr lines, by URL (shown where a test against it fails)
SERVER_LOGS: dict[str, list[str]] = {}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    proc = ServerProcess(
        "--threads", THREADS, "--max-sessions", "8", "--max-queue", "8", "--max-new-tokens", "64"
    )
    SERVER_LOGS[proc.url] = proc.log
    yield proc.url
    proc.stop()
    assert proc.proc.returncode is not None


@pytest.fixture(scope="module")
def tight_server(smollm2: Model) -> Iterator[str]:
    templateless = dataclasses.replace(
        smollm2, tokenizer=dataclasses.replace(smollm2.tokenizer, chat_template=None)
    )
    settings = ServerSettings(
        max_sessions=1, max_queue=1, max_prompt_tokens=16, max_new_tokens=64, max_body_bytes=4096
    )
    with serve_in_thread(create_app(templateless, settings)) as running:
        wait_until(lambda: httpx.get(f"{running.url}/health").status_code == 200, STARTUP_S)
        yield running.url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


# ---------------------------------------------------------------------------- helpers


def local_tokens(model: Model, spec: str, ids: list[int], n: int, sampling=None) -> list[int]:
    """What `larql run`'s loop generates for the same request, in this process."""
    engine = parse_engine(spec).build(model)
    return generate(engine, model, DenseFfn(model), ids, n, Sampler(sampling)).tokens


def complete(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=SETTLE_S)


def stream_completion(url: str, **body: Any) -> tuple[str, dict[str, Any]]:
    """Streamed text and the final chunk (the one with finish_reason)."""
    text, final = "", {}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=SETTLE_S
    ) as r:
        assert r.status_code == 200
        for data in sse_data(r):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            if chunk["choices"][0]["finish_reason"]:
                final = chunk
    return text, final


def sse_data(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def metrics(url: str) -> dict[str, Any]:
    """name → {labels tuple → value} for every sample of /metrics."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            key = tuple(sorted(sample.labels.items()))
            out.setdefault(sample.name, {})[key] = sample.value
    return out


def gauge(url: str, name: str) -> float:
    return metrics(url)[name][()]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param
    return error["message"]


# ---------------------------------------------------------------------------- the openai client


@pytest.mark.slow
def test_models_engines_health(server: str, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    engines = httpx.get(f"{server}/v1/engines").json()
    assert [e["name"] for e in engines["data"]] == supported_names()
    assert engines["default"] == "standard"
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL


def test_completion_is_larql_runs_generation(client: openai.OpenAI, smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(PROMPT)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    expected = local_tokens(smollm2, "standard", ids, 6)
    assert out.larql["token_ids"] == expected
    assert out.choices[0].text == smollm2.tokenizer.decode(expected)
    assert out.choices[0].text.startswith(" Paris")
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 6)
    assert out.larql["engine"] == "standard" and out.larql["memory_bytes"] > 0
    memory = out.larql["memory"]
    assert memory["state_bytes"] == out.larql["memory_bytes"]  # the state, reserve apart
    assert memory["held_bytes"] == memory["state_bytes"] + memory["reserve_bytes"]


def test_streamed_completion_equals_whole(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].larql["token_ids"] == whole.larql["token_ids"]
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices


def test_chat_whole_and_streamed(client: openai.OpenAI, smollm2: Model) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    ids = smollm2.tokenizer.encode_chat(messages)
    assert whole.larql["token_ids"] == local_tokens(smollm2, "standard", ids, 10)
    assert whole.choices[0].message.role == "assistant"
    assert "Paris" in whole.choices[0].message.content
    assert whole.usage.prompt_tokens == len(ids)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        whole.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_string_ends_and_is_trimmed(client: openai.OpenAI, server: str) -> None:
    # greedy continuation: " Paris.\n\nThe answer is:"
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=["\n"]
    )
    assert out.choices[0].text == " Paris."
    assert out.choices[0].finish_reason == "stop"
    text, final = stream_completion(server, prompt=PROMPT, max_tokens=8, temperature=0, stop="\n")
    assert text == " Paris." and final["choices"][0]["finish_reason"] == "stop"


def test_seed_gives_larql_runs_sample(client: openai.OpenAI, smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(PROMPT)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, top_p=0.9, seed=7)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    assert first.larql["token_ids"] == again.larql["token_ids"]
    assert first.larql["token_ids"] == local_tokens(smollm2, "standard", ids, 5, sampling)


def test_request_names_its_engine(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        extra_body={"engine": "markov-rs:window=2"},
    )
    assert out.larql["engine"] == "markov-rs:window=2"
    assert out.larql["memory_bytes"] > 0
    assert out.choices[0].text.startswith(" Paris")  # markov-rs is exact


# ---------------------------------------------------------------------------- isolation


def eight_engine_specs() -> list[str]:
    wanted = [
        "standard",
        "no-cache",
        "markov-rs:window=4",
        "standard:window=8",
        "turbo-quant:bits=3",
        "windowed-checkpoint:window=8",
        "markov-rs-codec:window=4",
        "boundary-kv:chunk_tokens=4",
        "boundary-per-layer",
    ]
    known = set(supported_names())
    specs = [s for s in wanted if s.split(":")[0] in known][:8]
    specs += [f"standard:window={w}" for w in (4, 5, 6, 7, 9, 10)][: 8 - len(specs)]
    return specs


@pytest.mark.slow
def test_concurrent_streams_with_different_engines_are_isolated(server: str) -> None:
    prompts = [
        PROMPT,
        "Water boils at",
        "The largest planet is",
        "Once upon a time",
        "My favourite colour is",
        "The opposite of hot is",
        "Two plus two equals",
        "The sun rises in the",
    ]
    jobs = list(zip(eight_engine_specs(), prompts, strict=True))
    alone = {}
    for spec, prompt in jobs:
        out = complete(server, prompt=prompt, max_tokens=6, temperature=0, engine=spec).json()
        alone[spec] = (out["choices"][0]["text"], out["larql"]["token_ids"])
    together: dict[str, tuple[str, list[int]]] = {}
    errors: dict[str, str] = {}
    start = threading.Barrier(len(jobs))

    def one(spec: str, prompt: str) -> None:
        start.wait()
        try:
            text, final = stream_completion(
                server, prompt=prompt, max_tokens=6, temperature=0, engine=spec
            )
        except Exception as e:  # shown below with the server's log
            errors[spec] = f"{type(e).__name__}: {e}"
            return
        together[spec] = (text, final["larql"]["token_ids"])

    threads = [threading.Thread(target=one, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SETTLE_S * 4)
    log = "".join(SERVER_LOGS.get(server, [])[-40:])
    assert together == alone, f"errors: {errors}\nthe server's log:\n{log}"


def test_streams_interleave_token_by_token(server: str) -> None:
    """A stream that starts while another decodes gets its first token before the other ends."""
    order: list[str] = []
    first_token = threading.Event()

    def read(name: str, signal: threading.Event | None) -> None:
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stream": True}
        body["ignore_eos"] = True
        with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=SETTLE_S) as r:
            for data in sse_data(r):
                if data == "[DONE]":
                    order.append(f"{name}:done")
                    return
                order.append(f"{name}:token")
                if signal is not None:
                    signal.set()

    long_one = threading.Thread(target=read, args=("a", first_token))
    long_one.start()
    assert first_token.wait(SETTLE_S)
    read("b", None)
    long_one.join(SETTLE_S)
    assert order.index("b:token") < order.index("a:done")


# ---------------------------------------------------------------------------- cancellation, health


def test_disconnect_cancels_and_frees_the_session(server: str) -> None:
    before = metrics(server).get("larql_sessions_total", {}).get((("outcome", "cancelled"),), 0)
    body = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "stream": True}
    body |= {"ignore_eos": True, "engine": "markov-rs"}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=SETTLE_S) as r:
        events = sse_data(r)
        next(events)  # one token, then hang up
        assert gauge(server, "larql_active_sessions") == 1
    wait_until(lambda: gauge(server, "larql_active_sessions") == 0, SETTLE_S)
    after = metrics(server)
    assert after["larql_sessions_total"][(("outcome", "cancelled"),)] == before + 1
    assert after["larql_engine_memory_bytes"][(("engine", "markov-rs"),)] == 0


def test_a_waiting_whole_response_is_cancelled_when_the_client_leaves(server: str) -> None:
    before = metrics(server).get("larql_sessions_total", {}).get((("outcome", "cancelled"),), 0)
    body = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # 64 tokens take far longer than 0.2 s on a CPU
        httpx.post(f"{server}/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.2))
    wait_until(lambda: gauge(server, "larql_active_sessions") == 0, SETTLE_S)
    cancelled = metrics(server)["larql_sessions_total"][(("outcome", "cancelled"),)]
    assert cancelled == before + 1


def test_health_answers_while_a_long_generation_runs(server: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=SETTLE_S) as r:
        events = sse_data(r)
        next(events)
        health = httpx.get(f"{server}/health", timeout=SETTLE_S).json()
        assert health["active_sessions"] == 1  # answered while the session was decoding
        assert list(events)[-1] == "[DONE]"


# ---------------------------------------------------------------------------- bad input

BAD_COMPLETIONS: list[tuple[str, Any, int, str | None, str]] = [
    # (case, body or raw bytes, status, param, words the message must contain)
    ("invalid json", b'{"prompt": ', 400, None, "not valid JSON"),
    ("not an object", b"[1, 2]", 400, None, "JSON object"),
    ("empty body", b"", 400, None, "missing"),
    ("missing prompt", {"max_tokens": 2}, 400, "prompt", "prompt"),
    ("prompt mistyped", {"prompt": 5}, 400, "prompt", "prompt"),
    ("two prompts streamed", {"prompt": ["a", "b"], "stream": True}, 400, "stream", "one prompt"),
    ("max_tokens mistyped", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ("max_tokens fraction", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens", "integer"),
    ("max_tokens zero", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "echo=true"),
    ("max_tokens negative", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens", "≥ 1"),
    ("max_tokens over limit", {"prompt": "hi", "max_tokens": 65}, 400, "max_tokens", "limit"),
    ("temperature negative", {"prompt": "hi", "temperature": -1}, 400, "temperature", "0"),
    ("temperature string", {"prompt": "hi", "temperature": "0.5"}, 400, "temperature", "number"),
    ("top_p zero", {"prompt": "hi", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("stream mistyped", {"prompt": "hi", "stream": "yes"}, 400, "stream", "boolean"),
    ("stop mistyped", {"prompt": "hi", "stop": [1]}, 400, "stop", "string"),
    ("seed mistyped", {"prompt": "hi", "seed": "x"}, 400, "seed", "integer"),
    ("seed too large", {"prompt": "hi", "seed": 2**70}, 400, "seed", "less than"),
    ("lone surrogate", b'{"prompt": "a\\ud800"}', 400, "prompt", "Unicode"),
    ("n > 1", {"prompt": "hi", "n": 2}, 400, "n", "n=1"),
    ("empty prompt", {"prompt": ""}, 400, "prompt", "empty"),
    ("blank prompt", {"prompt": "   "}, 400, "prompt", "empty"),
    ("empty token list", {"prompt": []}, 400, "prompt", "empty"),
    ("token id out of range", {"prompt": [10**7]}, 400, "prompt", "token ids"),
    ("prompt over context", {"prompt": [1] * 8192}, 400, "prompt", "context"),
    ("unknown model", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "unknown model"),
    ("unknown engine", {"prompt": "hi", "engine": "foo"}, 400, "engine", "supported: standard"),
    (
        "malformed engine",
        {"prompt": "hi", "engine": "markov-rs:window=abc"},
        400,
        "engine",
        "not an integer",
    ),
    ("unknown engine param", {"prompt": "hi", "engine": "standard:x=1"}, 400, "engine", "x"),
    ("apollo", {"prompt": "hi", "engine": "apollo"}, 400, "engine", "not available for live"),
    (
        "engine path param",
        {"prompt": "hi", "engine": "boundary-kv:archive=/tmp/larql-x"},
        400,
        "engine",
        "path on the server",
    ),
]


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [case[1:] for case in BAD_COMPLETIONS],
    ids=[case[0] for case in BAD_COMPLETIONS],
)
def test_bad_completion_request(
    server: str, body: Any, status: int, param: str | None, words: str
) -> None:
    url = f"{server}/v1/completions"
    if isinstance(body, bytes):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(url, json=body, timeout=SETTLE_S)
    assert words in assert_openai_error(response, status, param)


BAD_CHATS: list[tuple[str, Any, str]] = [
    ("no messages field", {"max_tokens": 2}, "messages"),
    ("empty messages", {"messages": []}, "messages"),
    ("blank messages", {"messages": [{"role": "user", "content": " "}]}, "messages"),
    ("unknown role", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("content mistyped", {"messages": [{"role": "user", "content": 3}]}, "messages"),
    ("lone surrogate", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    (
        "image part",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        "messages",
    ),
]


@pytest.mark.parametrize(
    ("body", "param"), [c[1:] for c in BAD_CHATS], ids=[c[0] for c in BAD_CHATS]
)
def test_bad_chat_request(server: str, body: Any, param: str) -> None:
    url = f"{server}/v1/chat/completions"
    if isinstance(body, bytes):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(url, json=body, timeout=SETTLE_S)
    assert_openai_error(response, 400, param)


@pytest.mark.parametrize(
    "content_type", ["application/x-www-form-urlencoded", "text/plain", None]
)  # curl -d, a bare client, no header at all
def test_a_json_body_is_read_whatever_its_content_type(
    server: str, smollm2: Model, content_type: str | None
) -> None:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 3, "temperature": 0}).encode()
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(f"{server}/v1/completions", content=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    ids = smollm2.tokenizer.encode(PROMPT)
    assert response.json()["larql"]["token_ids"] == local_tokens(smollm2, "standard", ids, 3)
    not_json = httpx.post(f"{server}/v1/completions", content=b"prompt=hi", headers=headers)
    assert "not valid JSON" in assert_openai_error(not_json, 400)


def test_unknown_route_and_method_are_openai_errors(server: str) -> None:
    assert "/v1/nope" in assert_openai_error(httpx.get(f"{server}/v1/nope"), 404)
    assert "GET" in assert_openai_error(httpx.get(f"{server}/v1/completions"), 405)


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 1e-300}, {"temperature": 2.0, "top_p": 1e-300}],
    ids=["temperature far below float32", "top_p far below float32"],
)
def test_extreme_sampling_values_are_greedy_not_errors(server: str, sampling: dict) -> None:
    out = complete(server, prompt=PROMPT, max_tokens=3, seed=1, **sampling)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"].startswith(" Paris")


def test_openai_client_sees_a_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"engine": "apollo"})
    assert "not available for live decode" in str(caught.value)


def test_still_serving_after_bad_input_and_metrics_parse(server: str) -> None:
    def count(status: str) -> float:
        requests = metrics(server).get("larql_requests_total", {})
        return requests.get((("endpoint", "/v1/completions"), ("status", status)), 0)

    before = {status: count(status) for status in ("200", "400", "404")}
    assert_openai_error(complete(server, prompt=PROMPT, max_tokens=0), 400)
    assert_openai_error(complete(server, prompt=PROMPT, model="gpt-4"), 404)
    text, final = stream_completion(server, prompt=PROMPT, max_tokens=3, temperature=0)
    assert text.startswith(" Paris") and final["choices"][0]["finish_reason"] == "length"
    assert {status: count(status) - before[status] for status in before} == {
        "200": 1,
        "400": 1,
        "404": 1,
    }
    seen = metrics(server)
    assert seen["larql_time_to_first_token_seconds_count"][()] >= 1
    assert seen["larql_time_per_output_token_seconds_count"][()] >= 2
    assert seen["larql_e2e_request_latency_seconds_count"][()] >= 1
    finished = seen["larql_sessions_total"][(("outcome", "finished"),)]
    assert seen["larql_completion_tokens_total"][()] >= finished >= 1
    assert seen["larql_prompt_tokens_total"][()] >= 5
    assert seen["larql_active_sessions"][()] == 0 and seen["larql_queued_sessions"][()] == 0
    held = seen["larql_engine_memory_bytes"]
    assert (("engine", "standard"),) in held and all(v == 0 for v in held.values())


# ---------------------------------------------------------------------------- tight limits


def test_full_queue_answers_429(tight_server: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "stream": True}
    body["ignore_eos"] = True  # long enough to still hold the slot while we look
    with httpx.stream("POST", f"{tight_server}/v1/completions", json=body, timeout=SETTLE_S) as a:
        events = sse_data(a)  # (held: a dropped iterator closes the connection)
        next(events)  # decoding: the one session slot is taken
        with httpx.stream(
            "POST", f"{tight_server}/v1/completions", json=body, timeout=SETTLE_S
        ) as b:
            assert b.status_code == 200
            wait_until(lambda: gauge(tight_server, "larql_queued_sessions") == 1, SETTLE_S)
            refused = complete(tight_server, prompt=PROMPT, max_tokens=2)
            assert_openai_error(refused, 429)
            assert int(refused.headers["retry-after"]) >= 1
    wait_until(
        lambda: (
            gauge(tight_server, "larql_active_sessions") == 0
            and gauge(tight_server, "larql_queued_sessions") == 0
        ),
        SETTLE_S,
    )
    after = complete(tight_server, prompt=PROMPT, max_tokens=2, temperature=0)
    assert after.status_code == 200 and after.json()["choices"][0]["text"].startswith(" Paris")


def test_prompt_over_max_prompt_tokens(tight_server: str) -> None:
    response = complete(tight_server, prompt="word " * 40, max_tokens=2)
    assert "--max-prompt-tokens" in assert_openai_error(response, 400, "prompt")
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_chat_without_a_template_is_refused(tight_server: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = httpx.post(f"{tight_server}/v1/chat/completions", json=body, timeout=SETTLE_S)
    assert "no chat template" in assert_openai_error(response, 400, "messages")


def test_oversized_body_is_refused(tight_server: str) -> None:
    response = complete(tight_server, prompt="word " * 1000, max_tokens=2)
    assert "limit is 4096" in assert_openai_error(response, 413)


# ---------------------------------------------------------------------------- start-up


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--engine", "apollo"], "not available for live decode"),
        (["--engine", "foo"], "supported: standard"),
        (["--engine", "markov-rs:window=abc"], "not an integer"),
        (["--max-sessions", "0"], "--max-sessions"),
        (["--max-queue", "-1"], "--max-queue"),
        (["--request-timeout", "0"], "--request-timeout"),
        (["--port", "70000"], "--port"),
        (["--layers", "0-3"], "--ffn-only"),
        (["--ffn-only", "--layers", "5-2"], "--layers"),
    ],
)
def test_serve_refuses_a_bad_start_up(args: list[str], words: str) -> None:
    result = CliRunner().invoke(app, ["serve", *args], env={ENV_VAR: ""})
    assert result.exit_code == 2
    assert words in result.output and "Traceback" not in result.output


def test_serve_default_engine_precedence(monkeypatch: pytest.MonkeyPatch, smollm2: Model) -> None:
    served: list[Any] = []
    monkeypatch.setattr(runner, "serve_forever", lambda app_, *_: served.append(app_))
    runs = [
        ({ENV_VAR: "markov-rs:window=8"}, [], "markov-rs:window=8"),
        ({ENV_VAR: "markov-rs:window=8"}, ["--engine", "tq3"], "turbo-quant:bits=3"),
        ({ENV_VAR: ""}, [], "standard"),
    ]
    for env, args, expected in runs:
        result = CliRunner().invoke(app, ["serve", "--port", "0", *args], env=env)
        assert result.exit_code == 0, result.output
        assert served[-1].state.settings.default_engine.spec() == expected


def test_ffn_only_dispatches_to_the_shard(monkeypatch: pytest.MonkeyPatch, smollm2: Model) -> None:
    from larql.server import ffn_shard

    calls: list[tuple] = []
    monkeypatch.setattr(ffn_shard, "run_ffn_shard", lambda *a: calls.append(a))
    for args, layers, experts in (
        (["--layers", "2-5"], (2, 5), None),
        ([], None, None),
        (["--experts", "0-3"], None, (0, 3)),
    ):
        result = CliRunner().invoke(app, ["serve", "--ffn-only", "--port", "0", *args])
        assert result.exit_code == 0, result.output
        model, got_layers, host, port, got_experts = calls[-1]
        assert (model.name, got_layers, host, port) == (MODEL, layers, "127.0.0.1", 0)
        assert got_experts == experts
    refused = CliRunner().invoke(app, ["serve", "--port", "0", "--experts", "0-3"])
    assert refused.exit_code == 2 and "--ffn-only" in refused.output


# long: both signals go to one handler (server/runner.py's _EXIT_SIGNALS), and
# test_server_shutdown's SIGTERM test ends open streams with an error event and exits 0 the same
# way, decoding on the main thread as here
@pytest.mark.long
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
@pytest.mark.slow
def test_a_signal_ends_open_streams_with_an_error_and_the_server_exits_cleanly(
    sig: signal.Signals,
) -> None:
    """`larql serve` decodes on its main thread and serves HTTP on another: a signal still ends
    every open stream with an error event, then the process exits 0."""
    proc = ServerProcess("--threads", THREADS, "--max-new-tokens", "4096")
    body = {"prompt": PROMPT, "max_tokens": 4096, "ignore_eos": True, "stream": True}
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{proc.url}/v1/completions", json=body, timeout=SETTLE_S) as r:
        for data in sse_data(r):
            if data == "[DONE]":
                break
            chunks.append(json.loads(data))
            if len(chunks) == 2:
                proc.proc.send_signal(sig)
    assert "error" in chunks[-1] and "shutting down" in chunks[-1]["error"]["message"]
    assert proc.proc.wait(SETTLE_S) == 0
