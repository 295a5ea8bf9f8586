"""`larql serve --tensor-parallel N`: rank 0 serves and schedules, the other ranks run its model
calls on their shares. Concurrent greedy requests, batched together as in one process, get one
process's tokens on the default model under three ranks; a server of two ranks on a tiny model
runs every kind of turn (batched steps with prompts riding, a step in parts, an echoed prompt
scored, a sampled stream) to one process's answers; SIGTERM ends every rank cleanly; a rank
that dies ends the server with an error, never a hang."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

import tensor_parallel_ranks
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate
from larql.kv import parse_engine
from larql.models import Model
from larql.parallel.launch import run_ranks
from tiny_models import build_tiny_model

LARQL = [sys.executable, "-m", "larql"]
STARTUP_S = 180  # bounds on waiting, never asserted as timings
SETTLE_S = 120


class Server:
    """`larql serve --port 0 …` in a subprocess: its URL once /health answers, its stderr."""

    def __init__(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "LARQL_KV_ENGINE"}
        self.proc = subprocess.Popen(
            [*LARQL, "serve", "--port", "0", "-q", *args],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        said: queue.Queue[str] = queue.Queue()

        def drain() -> None:  # keeps the pipe empty for the server's whole life
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.lines.append(line)
                said.put(line)
            said.put("")

        threading.Thread(target=drain, daemon=True).start()
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            line = said.get(timeout=STARTUP_S)
            if not line:
                break
            if " on http://" in line:
                self.url = line.split(" on ", 1)[1].split()[0]
                while httpx.get(f"{self.url}/health").status_code != 200:
                    time.sleep(0.05)
                return
        self.proc.kill()
        raise AssertionError(f"the server did not start: {''.join(self.lines)}")

    def ranks(self) -> list[int]:
        """The rank processes' ids, rank 0 first (the order they were started)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        pids = [int(p) for p in children.split()]
        return [p for p in pids if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]

    def complete(self, body: dict[str, Any], answers: dict[str, Any], key: str) -> None:
        sent = time.monotonic()
        r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=SETTLE_S)
        answers[key] = {**r.json(), "sent": sent, "answered": time.monotonic()}


def concurrently(server: Server, bodies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every body posted at once (each a little after the one before, so later ones join a
    batch already decoding) → each answer."""
    answers: dict[str, Any] = {}
    threads = []
    for key, body in bodies.items():
        thread = threading.Thread(target=server.complete, args=(body, answers, key))
        thread.start()
        threads.append(thread)
        time.sleep(0.3)
    for thread in threads:
        thread.join(SETTLE_S)
    return answers


@pytest.mark.slow
def test_three_ranks_serve_one_process_tokens_and_end_on_sigterm(smollm2_default: Model) -> None:
    """The default model under three ranks: two concurrent greedy requests (the second joins
    the first's batch) get the tokens `larql run` gets for each alone; SIGTERM ends every rank
    and the server exits 0."""
    prompts = {"a": ("The capital of France is", 12), "b": ("Once upon a time", 6)}
    server = Server("--tensor-parallel", "3")
    try:
        ranks = server.ranks()
        assert len(ranks) == 3
        bodies = {
            key: {"prompt": text, "max_tokens": n, "temperature": 0, "ignore_eos": True}
            for key, (text, n) in prompts.items()
        }
        answers = concurrently(server, bodies)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(SETTLE_S) == 0, "".join(server.lines)
    finally:
        server.proc.kill()
    assert "3 tensor-parallel ranks" in server.lines[0]
    assert answers["b"]["sent"] < answers["a"]["answered"]  # both in the server at once
    for key, (text, n) in prompts.items():
        ids = smollm2_default.tokenizer.encode(text)
        engine = parse_engine("standard").build(smollm2_default)
        ffn = DenseFfn(smollm2_default)
        alone = generate(engine, smollm2_default, ffn, ids, n, stop_ids=frozenset()).tokens
        assert answers[key]["larql"]["token_ids"] == alone, key
        assert answers[key]["choices"][0]["text"] == smollm2_default.tokenizer.decode(alone)
    for pid in ranks:  # every rank ended with the server
        assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama whose 4 query / 2 K/V heads split two ways."""
    pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("tp-serve-llama")
    build_tiny_model("llama", directory)
    return str(directory)


TINY_BODIES: dict[str, dict[str, Any]] = {
    # one batch of standard streams, later ones riding into the running step with their prompts
    "standard": {"prompt": [5, 17, 33, 9, 41, 8, 22], "max_tokens": 12},
    "standard-2": {"prompt": [7, 7, 60, 3, 12], "max_tokens": 8},
    # markov-rs batches apart from standard (its own group's steps)
    "markov-rs": {"prompt": [11, 23, 5, 88, 41], "max_tokens": 10, "engine": "markov-rs"},
    # no-cache recomputes the context: its steps go in parts (`--prefill-chunk 4`)
    "no-cache": {"prompt": [4, 9, 15, 16, 23, 42], "max_tokens": 6, "engine": "no-cache"},
    # an echoed prompt scored, nothing generated (the prompt's own turns)
    "echo": {"prompt": [30, 31, 32, 33, 34, 35], "max_tokens": 0, "echo": True, "logprobs": 2},
    # sampled: rank 0 draws, every rank feeds its token
    "sampled": {"prompt": [50, 51, 52], "max_tokens": 10, "temperature": 1.0, "seed": 7},
}


def _answers(model: str, *args: str) -> dict[str, Any]:
    server = Server("-m", model, "--prefill-chunk", "4", "--threads", "1", *args)
    try:
        bodies = {
            key: {"temperature": 0, "ignore_eos": True, **body} for key, body in TINY_BODIES.items()
        }
        answers = concurrently(server, bodies)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(SETTLE_S) == 0, "".join(server.lines)
    finally:
        server.proc.kill()
    return answers


@pytest.mark.slow
def test_two_ranks_run_every_kind_of_turn_as_one_process(tiny_llama: str) -> None:
    one = _answers(tiny_llama)
    two = _answers(tiny_llama, "--tensor-parallel", "2", "--prefix-cache-bytes", "0")
    for key in TINY_BODIES:
        assert "error" not in two[key], two[key]
        mine, theirs = two[key]["choices"][0], one[key]["choices"][0]
        assert two[key]["larql"]["token_ids"] == one[key]["larql"]["token_ids"], key
        assert mine["text"] == theirs["text"]
    scored = [
        (mine, theirs)
        for mine, theirs in zip(
            two["echo"]["choices"][0]["logprobs"]["token_logprobs"][1:],
            one["echo"]["choices"][0]["logprobs"]["token_logprobs"][1:],
            strict=True,
        )
    ]
    assert scored and all(abs(a - b) < 1e-4 for a, b in scored)


@pytest.mark.slow
def test_a_follower_that_dies_ends_the_server_with_an_error(tiny_llama: str) -> None:
    """A rank killed while the server idles: the server exits non-zero within seconds (well
    before the collectives' timeout), naming the rank, and no rank is left running."""
    server = Server("-m", tiny_llama, "--tensor-parallel", "2", "--threads", "1")
    try:
        ranks = server.ranks()
        answer = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
            timeout=SETTLE_S,
        )
        assert answer.status_code == 200
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        status = server.proc.wait(SETTLE_S)
        took = time.monotonic() - killed
    finally:
        server.proc.kill()
    assert status != 0 and took < 30
    said = "".join(server.lines)
    assert "error: tensor-parallel larql-rank-1 ended by signal 9" in said
    assert "Traceback" not in said
    assert not Path(f"/proc/{ranks[0]}").exists() or "Z" in _state(ranks[0])


def test_serve_refuses_what_ranks_cannot_split_before_starting() -> None:
    from typer.testing import CliRunner

    from larql.cli.app import app

    for args, named in (
        (["--prefix-cache-bytes", "1G"], "prefix cache"),
        (["--ffn-only"], "--ffn-only"),
        (["--engine", "boundary-kv:archive=frames"], "writes files"),
    ):
        result = CliRunner().invoke(app, ["serve", "--tensor-parallel", "3", *args])
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and named in lines[0], lines
    odd = CliRunner().invoke(app, ["serve", "--tensor-parallel", "2"])
    assert odd.exit_code == 2 and "valid sizes: 1, 3" in odd.stderr


@pytest.mark.slow
def test_an_idle_server_finds_a_rank_gone_at_its_next_heartbeat(
    tiny_llama: str, tmp_path: Path
) -> None:
    """No launcher watching (as under torchrun): rank 0's scheduler, idle, stops with the
    failed broadcast's error at a heartbeat, seconds after the other rank left."""
    out = tmp_path / "stopped.pt"
    options = {"model": tiny_llama, "out": str(out)}
    run_ranks(2, tensor_parallel_ranks.server_loses_a_rank, options, timeout=timedelta(seconds=60))
    raised, failure, seconds = torch.load(out)
    assert raised == "RankFailed" and "broadcast failed" in failure
    assert seconds < 30  # a heartbeat's, not the collectives' 60 s
