"""Ending cleanly on a signal. `larql serve` on SIGTERM refuses new work, lets running streams go
on for `--shutdown-timeout` seconds, then ends those still running with an error event followed
by `data: [DONE]` (never a cut connection), and exits 0. `larql run` on Ctrl-C (SIGINT) prints
what it generated so far and exits 130."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from larql.cli.app import app
from larql.kv.resolve import ENV_VAR

PROMPT = "The capital of France is"
STARTUP_S = 180  # bounds on waiting, never asserted as timings
SETTLE_S = 120
LARQL = str(Path(sys.executable).with_name("larql"))


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != ENV_VAR}


def _serve(*args: str) -> tuple[subprocess.Popen[str], str]:
    """`larql serve --port 0 …` → the process and its URL once /health answers."""
    proc = subprocess.Popen(
        [LARQL, "serve", "--port", "0", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=_environment(),
    )
    lines: queue.Queue[str] = queue.Queue()

    def drain() -> None:  # keeps the pipe empty for the server's whole life
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put("")

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        line = lines.get(timeout=STARTUP_S)
        if not line:
            break
        if " on http://" in line:
            url = line.split(" on ", 1)[1].split()[0]
            while httpx.get(f"{url}/health").status_code != 200:
                time.sleep(0.05)
            return proc, url
    proc.kill()
    raise AssertionError("the server did not start")


def _stream(url: str, max_tokens: int, chunks: list[dict[str, Any] | str]) -> None:
    """Stream a completion, appending every SSE data item (parsed, or "[DONE]") to `chunks`."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=SETTLE_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                chunks.append(data if data == "[DONE]" else json.loads(data))


@pytest.mark.slow
def test_sigterm_lets_streams_finish_then_ends_the_rest_cleanly() -> None:
    """Two open streams at SIGTERM: a short one finishes normally within the grace; a long
    one is ended when the grace is over with an error event and `[DONE]`; new requests are
    refused meanwhile; the process exits 0."""
    grace_s = 3
    share = os.environ.get("OMP_NUM_THREADS", "1")  # this test process's share of the cores
    proc, url = _serve(
        "--threads", share, "--max-new-tokens", "8000", "--shutdown-timeout", str(grace_s)
    )
    try:
        short: list[dict[str, Any] | str] = []
        long: list[dict[str, Any] | str] = []
        threads = [
            threading.Thread(target=_stream, args=(url, 6, short)),
            threading.Thread(target=_stream, args=(url, 8000, long)),
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + SETTLE_S
        while (len(short) < 2 or len(long) < 2) and time.monotonic() < deadline:
            time.sleep(0.02)  # both decoding
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        for thread in threads:
            thread.join(SETTLE_S)
        assert proc.wait(SETTLE_S) == 0
    finally:
        proc.kill()
    assert short[-1] == "[DONE]" and isinstance(short[-2], dict)
    assert short[-2]["choices"][0]["finish_reason"] == "length"
    assert len(short[-2]["larql"]["token_ids"]) == 6
    assert long[-1] == "[DONE]" and isinstance(long[-2], dict)
    assert "shutting down" in long[-2]["error"]["message"]
    assert time.monotonic() - signalled >= grace_s  # it ran on through the grace
    with pytest.raises(httpx.TransportError):  # nothing listens any more
        httpx.get(f"{url}/health", timeout=5)


def test_a_bad_shutdown_timeout_is_refused() -> None:
    result = CliRunner().invoke(app, ["serve", "--shutdown-timeout", "-1"], env={ENV_VAR: ""})
    assert result.exit_code == 2 and "--shutdown-timeout" in result.output


# `long` (make test-all): in the whole suite on a loaded 2-core machine the process was twice
# seen to have ended (exit 0) before the signal went out; alone it passes every time
@pytest.mark.slow
@pytest.mark.long
def test_ctrl_c_in_larql_run_prints_what_was_generated_and_exits_130() -> None:
    counting = (
        "Count from 1 to 1000: 1, 2, 3, 4, 5, 6, 7,"  # no end-of-turn for thousands of tokens
    )
    proc = subprocess.Popen(
        [LARQL, "run", counting, "-n", "4000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_environment(),
    )
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    printed = b""
    deadline = time.monotonic() + STARTUP_S
    while len(printed.split()) < 4 and proc.poll() is None and time.monotonic() < deadline:
        printed += proc.stdout.read() or b""
        time.sleep(0.02)
    running = proc.poll() is None
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=SETTLE_S)
    out = (printed + (rest or b"")).decode()
    assert running, f"the run ended before the signal: {out[-300:]!r} {err.decode()[-300:]!r}"
    assert proc.returncode == 130
    assert out.endswith("\n") and len(out.split()) >= 4  # the text so far, its line ended
    assert err.decode().strip().splitlines()[-1] == "interrupted"
    assert "Traceback" not in err.decode()


def test_ctrl_c_with_json_output_prints_the_text_so_far(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`-o json` interrupted mid-generation: one JSON object with the text so far and
    finish_reason "interrupted", then exit 130."""
    import larql.api

    def interrupted(*args: Any, on_text: Any = None, **kwargs: Any) -> None:
        for piece in (" Paris", ".", " It"):
            on_text(piece)
        raise KeyboardInterrupt

    monkeypatch.setattr(larql.api, "generate", interrupted)
    result = CliRunner().invoke(app, ["run", PROMPT, "-o", "json"], env={ENV_VAR: ""})
    assert result.exit_code == 130
    line = next(x for x in result.stdout.splitlines() if x.startswith("{"))
    shown = json.loads(line)
    assert shown["text"] == " Paris. It" and shown["finish_reason"] == "interrupted"
    assert shown["engine"] == "standard"
