"""Teacher-forced fidelity and bytes of quantised-K/V engine specs, for choosing defaults.

Runs `standard` once over the shipped licence text (16-token prompt, then every later token
fed as a decode step) and each spec the same way; prints per spec the mean / p99 KL(standard ‖
spec) in nats, same top-1, the state's bytes over an fp16 full cache at the final length, and
the average stored bits per K/V coordinate.

    .venv/bin/python benchmarks/kv_quant_levers.py --positions 512 \\
        "turbo-quant" "turbo-quant:norm=1" "turbo-quant:recent=32,sinks=4,norm=1"
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from larql.data import default_text
from larql.harness.accuracy.fidelity import measure_fidelity, reference_run
from larql.inference.ffn import DenseFfn
from larql.kv import parse_engine
from larql.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--positions", type=int, default=None, help="default: the whole text")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    ids = model.tokenizer.encode(default_text())[: model.config.max_positions]
    if args.positions is not None:
        ids = ids[: args.prompt + args.positions]
    ffn = DenseFfn(model)
    reference = reference_run(model, ffn, parse_engine("standard"), ids, args.prompt)
    print(f"{args.model}: {len(ids) - args.prompt} positions after a {args.prompt}-token prompt")
    print(f"{'spec':58} {'mean KL':>9} {'p99':>8} {'top-1':>7} {'× fp16':>7} {'s':>5}")
    for spec in args.specs:
        t0 = time.perf_counter()
        f = measure_fidelity(model, ffn, parse_engine(spec), ids, args.prompt, reference)
        if f.error:
            print(f"{spec:58} error: {f.error}")
            continue
        ratio = f.ratio_vs_fp16 or 0.0
        took = time.perf_counter() - t0
        mean = "nan" if math.isnan(f.mean_kl) else f"{f.mean_kl:.4f}"
        print(f"{spec:58} {mean:>9} {f.p99_kl:8.3f} {f.same_top1 * 100:6.1f}% "
              f"{ratio:7.3f} {took:5.0f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
