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
