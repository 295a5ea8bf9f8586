"""torch operators each engine's decode step dispatches, counted with torch.profiler: on a GPU
at batch 1 an eager step costs host time per operator, so this count is what an eager engine's
speed relative to `standard` comes down to there — measurable on any machine, unlike the GPU
host's timings, which drift between passes.

    .venv/bin/python benchmarks/ops_per_step.py [--engines "standard;markov-rs"]
        [--prompt-tokens 300] [--steps 4] [--dtype bfloat16] [--device cpu]

Counts `aten::` operators (views and copies included: each is a dispatch) per decode step,
after the engine's window has filled, and prints each engine's count over the first engine's.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from larql.data import default_text
from larql.harness.contexts import context_ids
from larql.inference.ffn import DenseFfn
from larql.kv import parse_engine, split_specs
from larql.models import load_model

DEFAULT_ENGINES = (
    "standard:graph=0;markov-rs;markov-rs:window=256;markov-rs-codec:window=256;"
    "boundary-per-layer:window=256;boundary-kv:chunk_tokens=128;windowed-checkpoint:window=256;"
    "turbo-quant:graph=0"
)


def aten_ops_per_step(model, spec: str, ids: list[int], steps: int) -> tuple[float, list]:
    """→ (aten operators per decode step, the 5 most frequent as (count per step, name))."""
    ffn = DenseFfn(model)
    engine = parse_engine(spec).build(model)
    with torch.inference_mode():
        engine.prefill(model, ffn, ids)
        for i in range(3):  # past any first-step setup
            engine.decode_step(model, ffn, 100 + i)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(steps):
                engine.decode_step(model, ffn, 200 + i)
    counts = [(e.count / steps, e.key) for e in prof.key_averages() if e.key.startswith("aten::")]
    return sum(c for c, _ in counts), sorted(counts, reverse=True)[:5]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--engines", default=DEFAULT_ENGINES)
    parser.add_argument("--prompt-tokens", "--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    ids = context_ids(model, args.prompt_tokens, default_text())
    first = None
    for spec in split_specs(args.engines):
        total, top = aten_ops_per_step(model, spec, ids, args.steps)
        first = first or total
        common = ", ".join(f"{name.removeprefix('aten::')} {count:.0f}" for count, name in top)
        print(f"{spec:34s} {total:7.0f} ops/step  {total / first:5.2f}x   ({common})", flush=True)


if __name__ == "__main__":
    main()
