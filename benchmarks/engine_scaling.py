"""Per-step decode cost of every engine at growing context depths, and how it grows.

    .venv/bin/python benchmarks/engine_scaling.py [--depths 256,1024,4096] [-n 16] [--repeats 1]
        [--engines "standard;markov-rs:window=256;..."] [--threads 2] [--json]

No engine should be slow by construction: a cached engine's step grows with the attention it
does (linear in the context), never with a copy of its whole state. `no-cache` re-runs the whole
context every step (O(N) per step, O(N²) total) and is shown for contrast at the first depth
only unless `--all-depths-for-no-cache` is given.
"""

from __future__ import annotations

import argparse
import json

import torch

from larql.data import default_text
from larql.harness.bench.engine_bench import BenchSettings, bench_engine
from larql.harness.contexts import context_ids
from larql.inference.ffn import DenseFfn
from larql.kv import parse_engine, split_specs
from larql.models import load_model

DEFAULT_ENGINES = (
    "standard;standard:window=256;no-cache;markov-rs;markov-rs:window=256;"
    "markov-rs-codec:window=256;windowed-checkpoint:window=256;turbo-quant:bits=4;"
    "turbo-quant:bits=3;boundary-kv:chunk_tokens=256;boundary-per-layer:window=256"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--engines", default=DEFAULT_ENGINES)
    parser.add_argument("--depths", default="256,1024,4096")
    parser.add_argument("-n", "--tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--all-depths-for-no-cache", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    ffn = DenseFfn(model)
    depths = [int(d) for d in args.depths.split(",")]
    settings = BenchSettings(new_tokens=args.tokens, warmup=args.warmup, repeats=args.repeats)
    text = default_text()
    results: dict[str, dict[int, float | None]] = {}
    for spec in split_specs(args.engines):
        kind = parse_engine(spec)
        results[spec] = {}
        for depth in depths:
            if (
                kind.display_name == "no-cache"
                and depth != depths[0]
                and not args.all_depths_for_no_cache
            ):
                results[spec][depth] = None
                continue
            row = bench_engine(model, ffn, kind, context_ids(model, depth, text), settings, depth)
            results[spec][depth] = row.step.mean if row.step and not row.error else None
    if args.json:
        print(json.dumps({"model": model.name, "threads": args.threads, "ms_per_step": results}))
        return
    print(
        f"{model.name}, float32, {args.threads} threads, ms per decode step (mean of "
        f"{args.tokens} steps × {args.repeats} runs), "
        "growth = last depth / first depth"
    )
    header = "".join(f"{d:>10}" for d in depths)
    print(f"{'engine':<34}{header}    growth")
    for spec, row in results.items():
        cells = "".join(f"{v:>10.1f}" if v is not None else f"{'—':>10}" for v in row.values())
        first, last = row[depths[0]], row[depths[-1]]
        growth = f"{last / first:.2f}×" if first and last else "—"
        print(f"{spec:<34}{cells}    {growth}")


if __name__ == "__main__":
    main()
