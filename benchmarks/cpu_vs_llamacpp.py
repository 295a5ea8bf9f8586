"""larql against llama.cpp on the CPU, the same GGUF, in interleaved rounds of fresh processes.

Each round runs llama.cpp (llama-cpp-python) once per `--cache-types` entry and then `larql
bench` once per `--engines` × `--dtypes` × `--weights`, every one in a process of its own, on
the same prompt token ids (the shipped text's first `--prompt-tokens`, as `larql bench
--prompt-tokens` cuts them), greedy, `--threads` threads. Prints median decode and prefill tok/s per
peer and each one's ratios against the first llama.cpp row.

`--cache-types` are llama.cpp's K/V cache types: `f16` (its default, the peer
docs/PERFORMANCE.md compares against), `f16-fa` (the same with flash attention), or `q8_0` /
`q4_0` (its quantised K/V cache, which needs and gets flash attention; q4_0 keeps 4.5 bits a
coordinate, turbo-quant's bytes at 4 bits). With `--engines "standard;turbo-quant;kv-quant"` and
a long prompt, the quantised K/V caches of both are timed side by side.

llama-cpp-python is not a dependency of larql: it builds llama.cpp from source (about 15
minutes on 2 cores), so it lives in a venv of its own, beside the checkout by default:

    python3 -m venv ../llama-venv && ../llama-venv/bin/pip install llama-cpp-python==0.3.36
    .venv/bin/python benchmarks/cpu_vs_llamacpp.py [--rounds 3] [--dtypes float32,bfloat16]
        [--weights auto,float] [--engines "standard;turbo-quant"] [--cache-types f16,q4_0]
        [--prompt-tokens 256] [--new-tokens 64] [--threads 2] [--llama-python PATH] [--json]

Without that venv the script says how to make it and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from larql.data import default_text
from larql.harness.contexts import context_ids
from larql.models import load_model
from larql.models.registry import resolve_model_path

DEFAULT_LLAMA_PYTHON = Path("..") / "llama-venv" / "bin" / "python"
INSTALL = "python3 -m venv ../llama-venv && ../llama-venv/bin/pip install llama-cpp-python==0.3.36"

# llama.cpp's K/V cache types by name → (its ggml type, flash attention); a quantised one
# needs flash attention, and `f16-fa` is the default cache with it, to tell the two apart
CACHE_TYPES = {"f16": (1, False), "f16-fa": (1, True), "q8_0": (8, True), "q4_0": (2, True)}

# Runs in the llama venv: argv = gguf path, threads, new tokens, cache type (ggml's number),
# flash attention (0 / 1); the prompt ids on stdin.
LLAMA_ROUND = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, new_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cache, flash = int(sys.argv[4]), bool(int(sys.argv[5]))
ids = json.loads(sys.stdin.read())
quantised = {"type_k": cache, "type_v": cache} if cache != 1 else {}
quantised.update({"flash_attn": True} if flash else {})
llm = Llama(model_path=path, n_ctx=len(ids) + new_tokens + 16, n_threads=threads,
            n_threads_batch=threads, n_batch=512, verbose=False, **quantised)
llm.reset()
t0 = time.perf_counter()
llm.eval(ids)
t1 = time.perf_counter()
for _ in range(3):  # warm-up steps, as larql bench's
    llm.eval([llm.sample(top_k=1, temp=0.0)])
t2 = time.perf_counter()
for _ in range(new_tokens):
    llm.eval([llm.sample(top_k=1, temp=0.0)])
t3 = time.perf_counter()
print(json.dumps({"decode_tok_s": new_tokens / (t3 - t2), "prefill_tok_s": len(ids) / (t1 - t0)}))
"""


def llama_round(
    python: Path, gguf: Path, ids: list[int], threads: int, new_tokens: int, cache: str = "f16"
) -> dict:
    done = subprocess.run(
        [
            str(python),
            "-c",
            LLAMA_ROUND,
            str(gguf),
            str(threads),
            str(new_tokens),
            str(CACHE_TYPES[cache][0]),
            str(int(CACHE_TYPES[cache][1])),
        ],
        input=json.dumps(ids),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def larql_round(
    model: str,
    dtype: str,
    weights: str,
    prompt_tokens: int,
    threads: int,
    new_tokens: int,
    engine: str = "standard",
) -> dict:
    larql = Path(sys.executable).with_name("larql")
    done = subprocess.run(
        [
            str(larql),
            "bench",
            "--model",
            model,
            "--engine",
            engine,
            "--dtype",
            dtype,
            "--weights",
            weights,
            "--prompt-tokens",
            str(prompt_tokens),
            "-n",
            str(new_tokens),
            "--repeats",
            "1",
            "--threads",
            str(threads),
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    row = json.loads(done.stdout)["rows"][0]
    prefill_tok_s = prompt_tokens / (row["prefill_ms"] / 1e3)
    return {"decode_tok_s": row["tok_s"], "prefill_tok_s": prefill_tok_s}


def add_peer_arguments(
    parser: argparse.ArgumentParser, prompt_tokens: int, new_tokens: int
) -> None:
    """The arguments every llama.cpp comparison takes."""
    parser.add_argument("--model", default="smollm2-135m", help="a registry name or a .gguf")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=prompt_tokens)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--llama-python", type=Path, default=Path(os.environ.get("LLAMA_PY", DEFAULT_LLAMA_PYTHON))
    )
    parser.add_argument("--json", action="store_true")


def peer_inputs(args: argparse.Namespace) -> tuple[Path, list[int]] | None:
    """(the GGUF, the prompt ids) both peers run; None (after saying how to build it) without
    the llama venv."""
    if not os.access(args.llama_python, os.X_OK):
        print(f"no llama-cpp-python at {args.llama_python}; build it (~15 minutes on 2 cores):")
        print(f"    {INSTALL}")
        return None
    _, gguf = resolve_model_path(args.model)
    if gguf.is_dir():
        sys.exit(f"{args.model} is an HF directory; llama.cpp needs a .gguf")
    return gguf, context_ids(load_model(args.model), args.prompt_tokens, default_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32", help="larql rows, comma-separated")
    parser.add_argument("--weights", default="auto", help="larql rows, comma-separated")
    parser.add_argument("--engines", default="standard", help="larql rows, ';'-separated specs")
    parser.add_argument(
        "--cache-types", default="f16", help=f"llama.cpp rows: {', '.join(CACHE_TYPES)}"
    )
    add_peer_arguments(parser, prompt_tokens=256, new_tokens=64)
    args = parser.parse_args()
    caches = args.cache_types.split(",")
    if unknown := [c for c in caches if c not in CACHE_TYPES]:
        sys.exit(f"unknown --cache-types {unknown}; accepted: {', '.join(CACHE_TYPES)}")

    inputs = peer_inputs(args)
    if inputs is None:
        return
    gguf, ids = inputs
    variants = [
        (e, d, w)
        for e in args.engines.split(";")
        for d in args.dtypes.split(",")
        for w in args.weights.split(",")
    ]
    llama_peers = {"llama.cpp" if c == "f16" else f"llama.cpp, K/V cache {c}": c for c in caches}
    larql_peers = {_larql_label(e, d, w, args.engines): (e, d, w) for e, d, w in variants}
    runs: dict[str, list[dict]] = {peer: [] for peer in [*llama_peers, *larql_peers]}
    for round_index in range(args.rounds):
        for peer, cache in llama_peers.items():
            runs[peer].append(
                llama_round(args.llama_python, gguf, ids, args.threads, args.new_tokens, cache)
            )
        for peer, (engine, dtype, weights) in larql_peers.items():
            timing = larql_round(
                args.model, dtype, weights, len(ids), args.threads, args.new_tokens, engine
            )
            runs[peer].append(timing)
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    medians = {
        peer: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        for peer, rows in runs.items()
    }
    base = medians[next(iter(llama_peers))]
    report = {
        "model": args.model,
        "gguf": gguf.name,
        "threads": args.threads,
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "peers": {
            peer: {
                **m,
                "decode_ratio": m["decode_tok_s"] / base["decode_tok_s"],
                "prefill_ratio": m["prefill_tok_s"] / base["prefill_tok_s"],
                "runs": runs[peer],
            }
            for peer, m in medians.items()
        },
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{gguf.name}, {len(ids)}-token prompt, {args.new_tokens} greedy tokens, "
        f"{args.threads} threads, median of {args.rounds} interleaved rounds"
    )
    print(
        f"| peer | decode tok/s | prefill tok/s | decode × {next(iter(llama_peers))} | prefill × |"
    )
    print("|---|---|---|---|---|")
    for peer, m in report["peers"].items():
        print(
            f"| {peer} | {m['decode_tok_s']:.1f} | {m['prefill_tok_s']:.0f} | "
            f"{m['decode_ratio']:.2f} | {m['prefill_ratio']:.2f} |"
        )


def _larql_label(engine: str, dtype: str, weights: str, engines: str) -> str:
    """A larql row's name: its engine where more than `standard` runs, its dtype and weights."""
    named = f"larql {dtype}, --weights {weights}"
    return named if engines == "standard" else f"larql {engine}, {dtype}, --weights {weights}"


if __name__ == "__main__":
    main()
