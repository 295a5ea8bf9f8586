"""`larql serve`'s access log: one stderr line per answered request — method, path, status,
milliseconds, the engine it decoded with — written when the answer has been sent in full (a
stream at its end); none with `--quiet` (the app without `access_log`)."""

from __future__ import annotations

import re

import httpx
import pytest

from larql.kv import parse_engine
from larql.models import Model
from larql.server.access_log import access_line
from larql.server.app import create_app
from larql.server.runner import serve_in_thread
from larql.server.settings import ServerSettings

LINE = re.compile(r"^(GET|POST) (\S+) (\d{3}) (\d+\.\d) ms engine=(\S+)$")


def logged(err: str) -> list[tuple[str, str, int, float, str]]:
    found = [LINE.match(line) for line in err.splitlines()]
    return [(m[1], m[2], int(m[3]), float(m[4]), m[5]) for m in found if m]


def test_the_line_format() -> None:
    line = access_line("POST", "/v1/completions", 200, 412.34, "markov-rs:window=64")
    assert line == "POST /v1/completions 200 412.3 ms engine=markov-rs:window=64"
    assert access_line("GET", "/health", 200, 0.5, None).endswith("engine=-")


@pytest.mark.slow
def test_every_request_is_logged_once(
    smollm2_default: Model, capfd: pytest.CaptureFixture[str]
) -> None:
    settings = ServerSettings(default_engine=parse_engine("standard"), access_log=True)
    with serve_in_thread(create_app(smollm2_default, settings)) as running:
        url = running.url
        assert httpx.get(f"{url}/health").status_code == 200
        body = {"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 2, "engine": "h2o"}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        streamed = {**body, "stream": True, "engine": "markov-rs:window=8"}
        with httpx.stream("POST", f"{url}/v1/completions", json=streamed, timeout=60) as r:
            assert r.status_code == 200 and "[DONE]" in r.read().decode()
        bad = {**body, "max_tokens": -1}
        assert httpx.post(f"{url}/v1/completions", json=bad, timeout=60).status_code == 400
    lines = logged(capfd.readouterr().err)
    assert [(m, p, s, e) for m, p, s, _, e in lines] == [
        ("GET", "/health", 200, "-"),
        ("POST", "/v1/completions", 200, "h2o"),
        ("POST", "/v1/completions", 200, "markov-rs:window=8"),
        ("POST", "/v1/completions", 400, "-"),
    ]
    assert all(ms >= 0 for *_, ms, _ in lines)


@pytest.mark.slow
def test_no_log_without_access_log(
    smollm2_default: Model, capfd: pytest.CaptureFixture[str]
) -> None:
    with serve_in_thread(create_app(smollm2_default, ServerSettings())) as running:
        assert httpx.get(f"{running.url}/health").status_code == 200
    assert logged(capfd.readouterr().err) == []


VERBOSE = re.compile(r" prompt=(\d+) cached=(\d+) new=(\d+) path=(.+)$")


def test_what_ran_sums_a_requests_sessions() -> None:
    from types import SimpleNamespace

    from larql.server.access_log import what_ran

    one = SimpleNamespace(prompt_tokens=5, cached_tokens=0, generated=3, decode_path="cpu · x")
    two = SimpleNamespace(prompt_tokens=2, cached_tokens=1, generated=0, decode_path=None)
    assert what_ran([one]) == "prompt=5 cached=0 new=3 path=cpu · x"
    assert what_ran([one, two]) == "choices=2 prompt=7 cached=1 new=3 path=cpu · x"
    assert what_ran([two]).endswith("path=-")


@pytest.mark.slow
def test_verbose_lines_say_what_each_request_ran(
    smollm2_default: Model, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """`larql serve -v`: a request that decoded adds its prompt, cached and new tokens and the
    decode path of its steps — the path `larql run -v` names for the same engine — and the
    scheduler's debug log says when each session starts and ends."""
    import logging

    caplog.set_level(logging.DEBUG, logger="larql.server")
    settings = ServerSettings(access_log=True, verbose=True)
    with serve_in_thread(create_app(smollm2_default, settings)) as running:
        url = running.url
        body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200
        ids = answer.json()["larql"]["token_ids"]
        listed = {**body, "prompt": ["Hi", "Hello there"], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=listed, timeout=60).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200
    err = capfd.readouterr().err.splitlines()
    lines = [line for line in err if line.startswith(("GET ", "POST "))]
    assert len(lines) == 3 and lines[2].endswith("engine=-")  # /health decoded nothing
    first = VERBOSE.search(lines[0])
    assert first is not None, lines[0]
    assert first.groups()[:3] == ("5", "0", str(len(ids)))
    from larql.api import generate

    alone = generate(smollm2_default, "standard", "The capital of France is", max_new_tokens=3)
    assert first[4] == alone.decode_path  # the server's steps ran what a run's ran
    assert " choices=2 prompt=" in lines[1] and " new=4 path=" in lines[1]
    logged = [r.getMessage() for r in caplog.records if r.name == "larql.server"]
    assert sum(m.startswith("session starts: standard, 5 prompt tokens") for m in logged) == 1
    assert sum(m.startswith("session ends: standard") for m in logged) == 3


def test_serve_verbose_states_what_it_serves(smollm2_default: Model) -> None:
    from larql.cli.serve_cmd import served_facts

    engine = parse_engine("markov-rs:window=64").build(smollm2_default)
    facts = served_facts(smollm2_default, engine, ServerSettings(prefix_cache_bytes=0))
    assert facts[0].startswith("model: smollm2-135m · 30 layers · context 8192 · cpu · float32")
    assert facts[1].startswith("engine: markov-rs [cpu] (window=64")
    assert "prompts up to 8191 tokens, up to 512 new tokens, 300 s a request" in facts[2]
    assert facts[3] == "prefix cache: off"
    sized = served_facts(smollm2_default, engine, ServerSettings(prefix_cache_bytes=2**30))
    assert sized[3] == "prefix cache: 1024.00 MiB of engine states"


@pytest.mark.slow
def test_larql_serve_verbose_end_to_end() -> None:
    """The command's flag reaches all three: the facts at start, the scheduler's debug log,
    each request's line with what it ran."""
    import os
    import queue
    import signal
    import subprocess
    import sys
    import threading
    from pathlib import Path

    from larql.kv.resolve import ENV_VAR

    larql = Path(sys.executable).with_name("larql")
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    proc = subprocess.Popen(
        [str(larql), "serve", "--port", "0", "-v"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line.rstrip("\n"))
            lines.put(line)
        lines.put("")

    threading.Thread(target=drain, daemon=True).start()
    try:
        url = None
        while url is None:
            line = lines.get(timeout=180)
            assert line, "".join(seen)
            found = re.search(r"on (http://\S+)", line)
            url = found[1] if found else None
        body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
        for _ in range(600):  # until the scheduler answers (bounded, never timed)
            try:
                answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                break
            except httpx.TransportError:
                threading.Event().wait(0.1)
        assert answer.status_code == 200
        while not any(x.startswith("POST /v1/completions 200") for x in seen):
            assert lines.get(timeout=60), "".join(seen)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert any(x.startswith("model: smollm2-135m · ") for x in seen), seen
    assert any(x.startswith("engine: standard [cpu]") for x in seen), seen
    assert any(x.startswith("larql.server DEBUG: session starts: standard") for x in seen), seen
    (logged,) = [x for x in seen if x.startswith("POST /v1/completions")]
    assert VERBOSE.search(logged) and " new=2 path=cpu · float32 · " in logged, logged
