"""Load on `larql serve` over loopback: concurrent streaming clients, the serving metrics vLLM's
`bench serve` reports (TTFT, TPOT, ITL, E2EL as mean / p50 / p99 ms; request and output-token
throughput; failures) and the server's RSS before and after a fixed number of requests.

    .venv/bin/python benchmarks/serve_load.py [--concurrency 4] [--duration 30] [--max-tokens 32]
        [--prompt-words 48] [--engine standard] [--weights auto] [--threads 2] [--rounds 3]
        [--rss-requests 200]
        [--rss-max-tokens 8]
        [--url URL --server-pid PID] [--json PATH]
    .venv/bin/python benchmarks/serve_load.py --shared-prefix WORDS …  (the prefix cache:
        questions about shared documents, with and without it; benchmarks/serve_prefix.py)

Phases (each bounded; the script stops by itself):
  1. start `larql serve --port 0` (or use --url; --server-pid lets it read the RSS);
  2. warm-up: --warmup requests at concurrency N (not measured);
  3. single: --single-requests requests one at a time (the single-request TTFT baseline);
  4. load: N clients, each sending a new request as soon as its last one ends, for --duration s;
     (3 and 4 alternate --rounds times, each round a share of the requests and of the seconds,
     and are reported over all rounds: a machine whose speed drifts weighs on both alike)
  5. RSS: VmRSS of the server, then --rss-requests requests (of --rss-max-tokens tokens) at
     concurrency N, then VmRSS again.
Every request streams (SSE), asks for exactly --max-tokens tokens (`ignore_eos`, as vLLM's
benchmark does) at temperature 0, over one of a few prompts cut from the Apache-2.0 text.
Targets: 0 errors; RSS growth ≤ 5 % after warm-up; TTFT p50 at N streams < 2× the single one;
output tokens/s at N streams over one stream's (continuous batching): ≥ 4× at 8 streams.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from larql.data import default_text

STARTUP_S = 180
REQUEST_TIMEOUT_S = 300


@dataclass
class Record:
    ok: bool
    e2e_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Record:
    t0 = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens = 0
    error = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return Record(False, time.perf_counter() - t0, error=f"{r.status_code}: {text}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]["message"]
                    break
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    if error is None and first is None:
        error = "no token arrived"
    ttft = None if first is None else first - t0
    return Record(error is None, end - t0, ttft, gaps, tokens, error)


async def run_phase(
    url: str,
    concurrency: int,
    bodies: itertools.cycle,
    requests: int | None = None,
    duration_s: float | None = None,
) -> tuple[list[Record], float]:
    """`concurrency` clients send requests back to back until `requests` have been sent or
    `duration_s` has passed (requests in flight then finish)."""
    records: list[Record] = []
    sent = itertools.count()
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def worker() -> None:
            while True:
                if requests is not None and next(sent) >= requests:
                    return
                if duration_s is not None and time.perf_counter() - start >= duration_s:
                    return
                records.append(await one_request(client, url, next(bodies)))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - start


def distribution(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean_ms": None, "p50_ms": None, "p99_ms": None}
    ms = np.asarray(values) * 1000
    return {
        "mean_ms": round(float(ms.mean()), 2),
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
    }


def summarise(records: list[Record], wall_s: float) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    output = sum(r.output_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_s": round(wall_s, 2),
        "request_throughput_rps": round(len(done) / wall_s, 3),
        "output_throughput_tok_s": round(output / wall_s, 2),
        "ttft": distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot": distribution([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl": distribution([g for r in done for g in r.itl_s]),
        "e2el": distribution([r.e2e_s for r in done]),
    }


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def prompts(words: int, count: int = 8) -> list[str]:
    text = default_text().split()
    step = max(1, (len(text) - words) // count)
    return [" ".join(text[i * step : i * step + words]) for i in range(count)]


def start_server(
    args: argparse.Namespace, extra: list[str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    larql = Path(sys.executable).with_name("larql")
    command = [
        str(larql),
        "serve",
        "--port",
        "0",
        "--threads",
        str(args.threads),
        "--max-sessions",
        str(args.concurrency),
        "--max-queue",
        str(args.concurrency),
        "--max-new-tokens",
        str(max(args.max_tokens, args.rss_max_tokens, 1)),
        "--engine",
        args.engine,
        "--weights",
        args.weights,
        *(extra or []),
    ]
    env = {**os.environ, "LARQL_KV_ENGINE": ""}
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    deadline = time.monotonic() + STARTUP_S
    for line in proc.stderr:
        if " on http://" in line:
            url = line.split(" on ", 1)[1].split()[0]
            break
        if time.monotonic() > deadline:
            break
    else:
        raise RuntimeError("the server did not start")
    # keep reading stderr so the pipe never fills
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError("the server never answered /health")


async def benchmark(args: argparse.Namespace, url: str, pid: int | None) -> dict[str, Any]:
    body = {"max_tokens": args.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    body |= {"stream_options": {"include_usage": True}, "engine": args.engine}
    texts = prompts(args.prompt_words)
    bodies = itertools.cycle([{**body, "prompt": p} for p in texts])
    short = {**body, "max_tokens": args.rss_max_tokens}
    short_bodies = itertools.cycle([{**short, "prompt": p} for p in texts])
    n = args.concurrency
    await run_phase(url, n, bodies, requests=args.warmup)
    # the single and the load phase in turn, `rounds` times, so a machine whose speed drifts
    # (shared hosts move by tens of percent within minutes) weighs on both alike
    single: list[Record] = []
    load: list[Record] = []
    single_s = load_s = 0.0
    per_round = -(-args.single_requests // args.rounds)
    for _ in range(args.rounds):
        records, wall = await run_phase(url, 1, bodies, requests=per_round)
        single, single_s = single + records, single_s + wall
        records, wall = await run_phase(url, n, bodies, duration_s=args.duration / args.rounds)
        load, load_s = load + records, load_s + wall
    rss_before = rss_bytes(pid) if pid else None
    rss_run, rss_s = await run_phase(url, n, short_bodies, requests=args.rss_requests)
    rss_after = rss_bytes(pid) if pid else None
    report: dict[str, Any] = {
        "url": url,
        "engine": args.engine,
        "weights": args.weights,
        "concurrency": n,
        "max_tokens": args.max_tokens,
        "rss_max_tokens": args.rss_max_tokens,
        "prompt_words": args.prompt_words,
        "threads": args.threads,
        "rounds": args.rounds,
        "single": summarise(single, single_s),
        "load": summarise(load, load_s),
        "rss_phase": summarise(rss_run, rss_s),
        "rss_before_bytes": rss_before,
        "rss_after_bytes": rss_after,
    }
    errors = sum(report[k]["failed"] for k in ("single", "load", "rss_phase"))
    single_ttft = report["single"]["ttft"]["p50_ms"]
    load_ttft = report["load"]["ttft"]["p50_ms"]
    growth = (rss_after - rss_before) / rss_before if rss_before and rss_after else None
    report["targets"] = {
        "errors": errors,
        "errors_ok": errors == 0,
        "rss_growth": None if growth is None else round(growth, 4),
        "rss_ok": None if growth is None else growth <= 0.05,
        "ttft_p50_ratio": round(load_ttft / single_ttft, 3) if single_ttft and load_ttft else None,
        "ttft_ok": bool(single_ttft and load_ttft and load_ttft < 2 * single_ttft),
        "throughput_ratio": _ratio(
            report["load"]["output_throughput_tok_s"], report["single"]["output_throughput_tok_s"]
        ),
    }
    return report


def _ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 3) if denominator else None


def print_report(r: dict[str, Any]) -> None:
    print(
        f"larql serve load — {r['url']}  engine {r['engine']}, weights {r.get('weights', 'auto')}, "
        f"{r['concurrency']} streams, {r['max_tokens']} tokens/request, "
        f"prompts of {r['prompt_words']} words"
    )
    header = f"{'phase':<10}{'ok':>5}{'fail':>5}{'req/s':>8}{'out tok/s':>10}"
    for metric in ("ttft", "tpot", "itl", "e2el"):
        header += f"{metric + ' p50':>11}{metric + ' p99':>11}"
    print(header + "   (ms)")
    for phase in ("single", "load", "rss_phase"):
        s = r[phase]
        row = f"{phase:<10}{s['completed']:>5}{s['failed']:>5}"
        row += f"{s['request_throughput_rps']:>8.2f}{s['output_throughput_tok_s']:>10.1f}"
        for metric in ("ttft", "tpot", "itl", "e2el"):
            d = s[metric]
            row += f"{_ms(d['p50_ms']):>11}{_ms(d['p99_ms']):>11}"
        print(row)
        for error in s["errors"]:
            print(f"  error: {error}")
    t = r["targets"]
    if r["rss_before_bytes"]:
        print(
            f"server RSS: {r['rss_before_bytes'] / 2**20:.1f} MiB before, "
            f"{r['rss_after_bytes'] / 2**20:.1f} MiB after {r['rss_phase']['completed']} "
            f"requests ({t['rss_growth']:+.2%}; target ≤ +5%: {_yes(t['rss_ok'])})"
        )
    print(f"errors: {t['errors']} (target 0: {_yes(t['errors_ok'])})")
    print(
        f"TTFT p50 at {r['concurrency']} streams / single: {t['ttft_p50_ratio']}× "
        f"(target < 2×: {_yes(t['ttft_ok'])})"
    )
    print(
        f"output tok/s at {r['concurrency']} streams / single: {t['throughput_ratio']}× "
        "(continuous batching; target at 8 streams ≥ 4×)"
    )


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _yes(ok: bool | None) -> str:
    return "n/a" if ok is None else ("yes" if ok else "NO")


def main() -> None:
    if "--shared-prefix" in sys.argv:
        import serve_prefix

        serve_prefix.run(serve_prefix.parser().parse_args())
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", "-c", type=int, default=4)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of the load phase")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--engine", default="standard")
    parser.add_argument("--weights", default="auto", help="the server's --weights")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--single-requests", type=int, default=10)
    parser.add_argument(
        "--rounds", type=int, default=3, help="single and load phases in turn, this many times"
    )
    parser.add_argument("--rss-requests", type=int, default=200)
    parser.add_argument("--rss-max-tokens", type=int, default=8, help="tokens/request, RSS phase")
    parser.add_argument("--url", help="use a running server instead of starting one")
    parser.add_argument("--server-pid", type=int, help="with --url: the server's pid (RSS)")
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")

    proc = None
    url, pid = args.url, args.server_pid
    if url is None:
        proc, url = start_server(args)
        pid = proc.pid
    try:
        report = asyncio.run(benchmark(args, url.rstrip("/"), pid))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
