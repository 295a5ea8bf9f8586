"""Fairness of `larql serve`: the longest gap between two tokens of running streams while one
adversarial request of each shape runs beside them.

    .venv/bin/python benchmarks/serve_fairness.py [--threads 2] [--victims 2]
        [--score-words 600] [--long-words 6000] [--shape-timeout 240] [--only NAME ...]
        [--url URL] [--json PATH]

For each shape: start --victims streaming requests (the server's default engine, greedy,
`ignore_eos`, as many tokens as the context allows), let them decode a few tokens, fire the
adversarial request, wait for it to end (or --shape-timeout seconds, then drop it), and report
the victims' largest gap between two content chunks from the moment it was sent until it ended
(and the gap with no adversary, the baseline), after a first request through every engine (a
fresh server's first calls allocate and plan). Target: every gap under 1 s.

On a machine other processes share, give the server fewer threads than cores (`--threads 1` on
two): an OpenMP team whose sibling thread waits for a busy core stalls at every barrier (a
2-thread decode step of the default model took ~0.95 s instead of ~5 ms beside one busy
process). The `load` column is the machine's 1-minute load average when each shape ended.

Shapes: a prompt near the whole context (default engine); echo + logprobs with max_tokens 0 (the
prompt scored, nothing generated) through every live engine; a prompt near the whole context
then two tokens through each engine whose policy works on a prompt once it is whole; a long
prompt generating through `no-cache` and through `markov-rs:kv_cache=0` (each step recomputes
from the whole context); a 2,048-token stream; sixteen prompts in one request; a multi-megabyte
prompt (refused for its length before it is tokenized); a chunked body over the body limit (413,
read no further). /health is polled through every shape. The server is started with
`--max-new-tokens` at the context, so a victim outlives every shape.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from larql.data import default_text

STARTUP_S = 300
CONTEXT = 8192  # the default model's
LIVE_ENGINES = (
    "standard",
    "no-cache",
    "markov-rs",
    "markov-rs:kv_cache=0",
    "markov-rs-codec:window=256",
    "windowed-checkpoint",
    "turbo-quant",
    "kv-quant",
    "snapkv",
    "h2o",
    "boundary-kv",
    "boundary-per-layer",
    "semantic-promotion:base=no-cache",
)

# their policy codes, cuts or re-derives the prompt's K/V once it is whole
POLICY_AFTER_PROMPT = ("turbo-quant", "kv-quant", "markov-rs-codec:window=256", "snapkv", "h2o")


@dataclass
class Shape:
    name: str
    body: dict[str, Any] | None  # None: a special request (`kind`)
    kind: str = "completion"


@dataclass
class Result:
    shape: str
    status: str  # the adversary's HTTP status, "timeout" (dropped), or what went wrong
    seconds: float  # how long the adversary ran
    prompt_tokens: int | None
    max_gap_s: float | None  # the victims' longest gap while it ran (None: no victim token)
    victim_tokens: int  # victims' tokens while it ran
    health_max_s: float | None = None  # the slowest /health answer while it ran
    note: str = ""
    load: float = field(default_factory=lambda: load_average())  # the machine's, at its end


@dataclass
class Victim:
    times: list[float] = field(default_factory=list)  # arrival of each content chunk
    error: str | None = None


def load_average() -> float:
    """The 1-minute load average (other processes on a shared machine slow the server)."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def words(n: int) -> str:
    """n words of the bundled text, repeated as needed."""
    text = default_text().split()
    return " ".join(text[i % len(text)] for i in range(n))


def shapes(score_words: int, long_words: int) -> list[Shape]:
    scored = [
        Shape(
            f"echo+logprobs, max_tokens 0, {engine}",
            {
                "prompt": words(score_words),
                "max_tokens": 0,
                "echo": True,
                "logprobs": 5,
                "engine": engine,
            },
        )
        for engine in LIVE_ENGINES
    ]
    finished = [  # engines whose policy works on a prompt once it is whole (then it decodes)
        Shape(
            f"long prompt, then 2 tokens, {engine}",
            {"prompt": words(long_words), "max_tokens": 2, "engine": engine, "ignore_eos": True},
        )
        for engine in POLICY_AFTER_PROMPT
    ]
    return [
        Shape("long prompt (default engine)", {"prompt": words(long_words), "max_tokens": 1}),
        Shape(
            "long prompt, echo+logprobs, max_tokens 1",
            {"prompt": words(long_words), "max_tokens": 1, "echo": True, "logprobs": 1},
        ),
        *scored,
        *finished,
        Shape(
            "no-cache generating after a long prompt",
            {
                "prompt": words(score_words),
                "max_tokens": 4,
                "engine": "no-cache",
                "ignore_eos": True,
            },
        ),
        Shape(
            "markov-rs:kv_cache=0 generating after a long prompt",
            {
                "prompt": words(score_words),
                "max_tokens": 8,
                "engine": "markov-rs:kv_cache=0",
                "ignore_eos": True,
            },
        ),
        Shape(
            "a long stream (2,048 tokens)",
            {
                "prompt": "Once upon a time",
                "max_tokens": 2048,
                "ignore_eos": True,
                "stream": True,
            },
        ),
        Shape(
            "sixteen prompts in one request",
            {"prompt": [words(40 + i) for i in range(16)], "max_tokens": 16, "ignore_eos": True},
        ),
        Shape("a 7.8 MB prompt", {"prompt": "word " * 1_560_000, "max_tokens": 1}),
        Shape("a chunked body over the limit", None, kind="chunked"),
    ]


class Server:
    """`larql serve --port 0` in a subprocess."""

    def __init__(self, args: list[str]) -> None:
        larql = Path(sys.executable).with_name("larql")
        command = [str(larql), "serve", "--port", "0", "--max-new-tokens", str(CONTEXT), *args]
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + STARTUP_S
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if " on http://" in line:
                self.url = line.split(" on ", 1)[1].split()[0]
                break
            if time.monotonic() > deadline:
                break
        else:
            raise RuntimeError("the server did not start")
        # keep the pipe drained for the server's whole life (it logs to stderr)
        threading.Thread(target=lambda: all(True for _ in self.proc.stderr), daemon=True).start()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


async def run_victim(client: httpx.AsyncClient, url: str, victim: Victim) -> None:
    body = {
        "prompt": "The history of the city",
        "max_tokens": CONTEXT - 16,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for data in sse(r):
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    victim.error = chunk["error"]["message"]
                    return
                if chunk["choices"][0]["text"]:
                    victim.times.append(time.perf_counter())
    except (httpx.HTTPError, asyncio.CancelledError) as e:
        if not isinstance(e, asyncio.CancelledError):
            victim.error = f"{type(e).__name__}: {e}"


async def sse(response: httpx.Response) -> AsyncIterator[str]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


async def fire(client: httpx.AsyncClient, url: str, shape: Shape) -> tuple[str, int | None, str]:
    """Send the adversarial request and wait for its end → (status, prompt tokens, note)."""
    if shape.kind == "chunked":
        return await asyncio.to_thread(chunked_body, url)
    assert shape.body is not None
    if shape.body.get("stream"):
        async with client.stream("POST", f"{url}/v1/completions", json=shape.body) as r:
            usage = None
            async for data in sse(r):
                if data != "[DONE]" and "larql" in (chunk := json.loads(data)):
                    usage = len(chunk["larql"]["token_ids"])
            return str(r.status_code), None, f"{usage} tokens streamed"
    r = await client.post(f"{url}/v1/completions", json=shape.body)
    if r.status_code != 200:
        return str(r.status_code), None, r.json()["error"]["message"][:80]
    return "200", r.json()["usage"]["prompt_tokens"], ""


def chunked_body(url: str, meant: int = 200 * 2**20) -> tuple[str, int | None, str]:
    """POST a chunked body of `meant` bytes, 64 kB a chunk, reading the answer as soon as it
    comes → (status, None, how much was sent by then)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    piece, sent, answer = 64 * 1024, 0, b""
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        while sent < meant and not answer:
            try:
                sock.sendall(f"{piece:x}\r\n".encode() + b" " * piece + b"\r\n")
            except OSError:
                break
            sent += piece
            if select.select([sock], [], [], 0.01)[0]:
                answer = sock.recv(65536)
        if not answer and select.select([sock], [], [], 60)[0]:
            answer = sock.recv(65536)
    status = answer.split(b"\r\n", 1)[0].split(b" ")[1].decode() if answer else "none"
    return status, None, f"{sent / 2**20:.1f} MB sent before the answer"


async def health_probe(client: httpx.AsyncClient, url: str, slowest: list[float]) -> None:
    while True:
        t0 = time.perf_counter()
        await client.get(f"{url}/health")
        slowest.append(time.perf_counter() - t0)
        await asyncio.sleep(0.2)


def largest_gap(times: list[float], start: float, end: float) -> float | None:
    """The longest wait for a token between `start` and `end` (the time from `start` to the
    first token after it counts, and from the last token to `end`)."""
    inside = [t for t in times if start <= t <= end]
    if not inside:
        return None
    edges = [start, *inside, end]
    return max(b - a for a, b in itertools.pairwise(edges))


async def one_shape(url: str, shape: Shape, victims: int, timeout_s: float) -> Result:
    limits = httpx.Limits(max_connections=victims + 4)
    async with httpx.AsyncClient(timeout=timeout_s + 60, limits=limits) as client:
        running = [Victim() for _ in range(victims)]
        tasks = [asyncio.create_task(run_victim(client, url, v)) for v in running]
        while min(len(v.times) for v in running) < 4:  # every victim decoding
            if any(v.error for v in running):
                raise RuntimeError(f"a victim failed: {[v.error for v in running]}")
            await asyncio.sleep(0.05)
        slowest: list[float] = []
        health = asyncio.create_task(health_probe(client, url, slowest))
        start = time.perf_counter()
        try:
            status, prompt_tokens, note = await asyncio.wait_for(
                fire(client, url, shape), timeout_s
            )
        except TimeoutError:
            status, prompt_tokens, note = "timeout", None, f"dropped after {timeout_s:g} s"
        end = time.perf_counter()
        health.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, health, return_exceptions=True)
    gaps = [largest_gap(v.times, start, end) for v in running]
    known = [g for g in gaps if g is not None]
    errors = [v.error for v in running if v.error]
    return Result(
        shape.name,
        status,
        end - start,
        prompt_tokens,
        max(known) if len(known) == len(gaps) else None,
        sum(len([t for t in v.times if start <= t <= end]) for v in running),
        max(slowest) if slowest else None,
        "; ".join([note, *errors]).strip("; "),
    )


async def warm_up(url: str) -> None:
    """A first request of each path (a fresh server's first calls allocate and plan)."""
    async with httpx.AsyncClient(timeout=300) as client:
        for engine in LIVE_ENGINES:
            body = {
                "prompt": words(40),
                "max_tokens": 2,
                "echo": True,
                "logprobs": 1,
                "engine": engine,
                "ignore_eos": True,
            }
            await client.post(f"{url}/v1/completions", json=body)


async def baseline(url: str, victims: int, seconds: float = 10.0) -> Result:
    async with httpx.AsyncClient(timeout=60) as client:
        running = [Victim() for _ in range(victims)]
        tasks = [asyncio.create_task(run_victim(client, url, v)) for v in running]
        while min(len(v.times) for v in running) < 4:
            await asyncio.sleep(0.05)
        start = time.perf_counter()
        await asyncio.sleep(seconds)
        end = time.perf_counter()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    gaps = [largest_gap(v.times, start, end) or seconds for v in running]
    tokens = sum(len([t for t in v.times if start <= t <= end]) for v in running)
    return Result("(no adversary: baseline)", "-", end - start, None, max(gaps), tokens)


def report(results: list[Result]) -> None:
    print(
        f"{'shape':58} {'status':>6} {'ran s':>6} {'prompt':>6} {'max gap s':>9} "
        f"{'tokens':>6} {'/health s':>9} {'load':>5}  note"
    )
    for r in results:
        gap = f"{r.max_gap_s:.3f}" if r.max_gap_s is not None else "none"
        health = f"{r.health_max_s:.3f}" if r.health_max_s is not None else "-"
        prompt = str(r.prompt_tokens) if r.prompt_tokens is not None else "-"
        print(
            f"{r.shape:58} {r.status:>6} {r.seconds:6.1f} {prompt:>6} {gap:>9} "
            f"{r.victim_tokens:>6} {health:>9} {r.load:5.2f}  {r.note}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--victims", type=int, default=2)
    parser.add_argument("--score-words", type=int, default=600)
    parser.add_argument("--long-words", type=int, default=6000)
    parser.add_argument("--shape-timeout", type=float, default=240.0)
    parser.add_argument("--only", nargs="*", help="shapes whose name contains one of these")
    parser.add_argument("--url", help="a running server (started with --max-new-tokens 8192)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    server = None
    if args.url is None:
        extra = ["--threads", str(args.threads)] if args.threads else []
        server = Server([*extra, "--request-timeout", str(args.shape_timeout + 60)])
        url = server.url
    else:
        url = args.url
    chosen = [
        s
        for s in shapes(args.score_words, args.long_words)
        if not args.only or any(part in s.name for part in args.only)
    ]
    results: list[Result] = []
    try:
        asyncio.run(warm_up(url))
        results.append(asyncio.run(baseline(url, args.victims)))
        for shape in chosen:
            results.append(asyncio.run(one_shape(url, shape, args.victims, args.shape_timeout)))
            print(f"done: {results[-1]}", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.stop()
        report(results)
        if args.json is not None:
            args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
