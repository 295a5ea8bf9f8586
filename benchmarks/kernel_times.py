"""Where a batched decode step's GPU time goes, kernel by kernel: sessions of each engine
prefilled to a context, then decoded together (`decode_batch`) under torch.profiler; prints
each engine's kernels by GPU time per step, and the step's wall time.

    python benchmarks/kernel_times.py --model DIR --engines "standard;turbo-quant:bits=4" \\
        [--sessions 64] [--context 128] [--steps 8] [--dtype bfloat16]

Made for one GPU (the CUDA graphs' kernels are profiled as they replay); on the CPU it lists
the CPU operators instead.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from larql.data import default_text
from larql.harness.contexts import context_ids
from larql.inference.batching import decode_batch
from larql.inference.ffn import DenseFfn
from larql.kv import parse_engine, split_specs
from larql.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--engines", default="standard;turbo-quant:bits=4")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per engine")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(args.model, dtype=getattr(torch, args.dtype), device=device)
    ffn = DenseFfn(model)
    ids = context_ids(model, args.context, default_text())
    cuda = device == "cuda"
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    for spec in split_specs(args.engines):
        engines = [parse_engine(spec).build(model) for _ in range(args.sessions)]
        with torch.inference_mode():
            for engine in engines:
                engine.prefill(model, ffn, ids)
            tokens = [ids[-1]] * args.sessions
            for _ in range(3):  # warm-up: compiles, captures the graphs
                decode_batch(engines, model, ffn, tokens)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with profile(activities=[activity]) as prof:
                for _ in range(args.steps):
                    decode_batch(engines, model, ffn, tokens)
                if cuda:
                    torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / args.steps
        print(
            f"\n== {spec}: {args.sessions} sessions at {args.context} tokens, "
            f"{wall * 1e3:.3f} ms a step (profiled) =="
        )
        events = [
            e
            for e in prof.key_averages()
            if (e.device_time_total if cuda else e.cpu_time_total) > 0
        ]
        key = (lambda e: e.device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
        total = sum(key(e) for e in events) if cuda else None
        if total is not None:
            print(f"kernels: {total / args.steps / 1e3:.3f} ms a step")
        for event in sorted(events, key=key, reverse=True)[: args.top]:
            per_step = key(event) / args.steps
            calls = event.count / args.steps
            print(f"{per_step:9.1f} µs  {calls:6.1f}×  {event.key[:100]}")
        del engines


if __name__ == "__main__":
    main()
