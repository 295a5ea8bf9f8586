"""The prefix cache of `larql serve` under questions about shared documents: two servers side by
side, one with the cache (`--prefix-cache-bytes`, default the server's) and one without (0),
measured in turn.

    .venv/bin/python benchmarks/serve_load.py --shared-prefix 1160 [--engine standard]
        [--concurrency 8] [--duration 30] [--rounds 3] [--max-tokens 8] [--threads 2]
        [--questions 4] [--json PATH]

(or `benchmarks/serve_prefix.py` with the same arguments). The shared prefix is a document of
that many words of the Apache-2.0 text (on SmolLM2 1,160 words are ~1,500 tokens); each request
is the document and a question of its own. Each round takes a new document, so its first question
finds nothing cached:
  1. questions one at a time: on the cached server the document's first question (cold) and
     then `--questions - 1` more (warm); the same questions on the uncached server;
  2. load: `--concurrency` clients asking questions about the round's document back to back for
     `--duration / --rounds` seconds, on each server in turn.
Targets: warm time to first token ≥ 10× lower than cold; output tokens/s with the cache ≥ 3× that
without it at 8 clients.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import httpx
from serve_load import Record, one_request, run_phase, start_server, summarise

from larql.data import default_text


def documents(words: int, count: int) -> list[str]:
    """`count` different documents of `words` words (windows of the Apache-2.0 text, repeated
    where it is shorter)."""
    text = default_text().split()
    while len(text) < words + count * 37:
        text = text + text
    return [" ".join(text[i * 37 : i * 37 + words]) for i in range(count)]


def question_bodies(args: argparse.Namespace, document: str) -> list[dict[str, Any]]:
    body = {"max_tokens": args.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    body |= {"stream_options": {"include_usage": True}, "engine": args.engine}
    asks = ("Who may grant it?", "What must be kept?", "What is a Contribution?", "Is it free?")
    return [
        {**body, "prompt": f"{document}\nQuestion {i}: {asks[i % len(asks)]}\nAnswer:"}
        for i in range(64)
    ]


async def one_at_a_time(url: str, bodies: list[dict[str, Any]]) -> list[Record]:
    async with httpx.AsyncClient(timeout=600) as client:
        return [await one_request(client, url, body) for body in bodies]


async def benchmark(args: argparse.Namespace, servers: dict[str, str]) -> dict[str, Any]:
    docs = documents(args.shared_prefix, args.rounds + 1)
    warmup = question_bodies(args, docs[-1])[:2]
    for url in servers.values():
        await one_at_a_time(url, warmup)
    cold: dict[str, list[Record]] = {name: [] for name in servers}
    warm: dict[str, list[Record]] = {name: [] for name in servers}
    load: dict[str, list[Record]] = {name: [] for name in servers}
    load_s = dict.fromkeys(servers, 0.0)
    for document in docs[: args.rounds]:
        bodies = question_bodies(args, document)
        for name, url in servers.items():
            records = await one_at_a_time(url, bodies[: args.questions])
            cold[name].append(records[0])
            warm[name] += records[1:]
        for name, url in servers.items():
            cycle = itertools.cycle(bodies[args.questions :])
            seconds = args.duration / args.rounds
            records, wall = await run_phase(url, args.concurrency, cycle, duration_s=seconds)
            load[name] += records
            load_s[name] += wall
    report: dict[str, Any] = {
        "engine": args.engine,
        "shared_prefix_words": args.shared_prefix,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "questions": args.questions,
        "threads": args.threads,
    }
    for name in servers:
        report[name] = {
            "cold": summarise(cold[name], 1.0)["ttft"],
            "warm": summarise(warm[name], 1.0)["ttft"],
            "load": summarise(load[name], load_s[name]),
        }
    on, off = report["cached"], report["uncached"]
    report["targets"] = {
        "warm_vs_cold_ttft": _ratio(on["cold"]["p50_ms"], on["warm"]["p50_ms"]),
        "warm_vs_uncached_ttft": _ratio(off["warm"]["p50_ms"], on["warm"]["p50_ms"]),
        "throughput_cached_vs_uncached": _ratio(
            on["load"]["output_throughput_tok_s"], off["load"]["output_throughput_tok_s"]
        ),
        "errors": sum(report[n]["load"]["failed"] for n in servers)
        + sum(1 for n in servers for r in cold[n] + warm[n] if not r.ok),
    }
    return report


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 2) if numerator and denominator else None


def print_report(r: dict[str, Any]) -> None:
    print(
        f"larql serve prefix cache — engine {r['engine']}, documents of {r['shared_prefix_words']} "
        f"words, {r['concurrency']} clients, {r['max_tokens']} tokens/answer, {r['rounds']} rounds"
    )
    print(f"{'server':<10}{'cold TTFT p50':>15}{'warm TTFT p50':>15}{'load out tok/s':>16}")
    for name in ("cached", "uncached"):
        s = r[name]
        print(
            f"{name:<10}{s['cold']['p50_ms']:>12.1f} ms{s['warm']['p50_ms']:>12.1f} ms"
            f"{s['load']['output_throughput_tok_s']:>16.1f}"
        )
    t = r["targets"]
    print(
        f"warm / cold TTFT with the cache: {t['warm_vs_cold_ttft']}× (target ≥ 10×); "
        f"tok/s cached / uncached at {r['concurrency']} clients: "
        f"{t['throughput_cached_vs_uncached']}× (target ≥ 3×); errors {t['errors']}"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=1160,
        help="words of each document (1,160: ~1,500 tokens)",
    )
    p.add_argument("--engine", default="standard")
    p.add_argument("--concurrency", "-c", type=int, default=8)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load per server")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--questions", type=int, default=4, help="one-at-a-time questions a round")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--weights", default="auto")
    p.add_argument("--prefix-cache-bytes", default=None, help="the cached server's size")
    p.add_argument("--json", help="also write the report to this file")
    return p


def run(args: argparse.Namespace) -> None:
    if args.rounds < 1 or args.questions < 2:
        raise SystemExit("--rounds must be ≥ 1 and --questions ≥ 2")
    args.rss_max_tokens = args.max_tokens
    sizes = {"cached": args.prefix_cache_bytes, "uncached": "0"}
    procs, servers = [], {}
    try:
        for name, size in sizes.items():
            extra = [] if size is None else ["--prefix-cache-bytes", size]
            proc, url = start_server(args, extra)
            procs.append(proc)
            servers[name] = url
        report = asyncio.run(benchmark(args, servers))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    run(parser().parse_args())
