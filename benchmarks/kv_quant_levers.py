"""Teacher-forced fidelity and bytes of quantised-K/V engine specs, for choosing defaults.

Runs `standard` once over the shipped licence text (16-token prompt, then every later token
fed as a decode step) and each spec the same way; prints per spec the mean / p99 KL(standard ‖
spec) in nats, same top-1, the greedy step where tokens first differ, the ln perplexity ratio
and the state's bytes over an fp16 full cache at the final length. `--jsonl FILE` appends each
result as it comes; `--plot FILE` draws KL against bytes for the specs of the run.

    .venv/bin/python benchmarks/kv_quant_levers.py --positions 512 \\
        "turbo-quant" "turbo-quant:norm=1" "turbo-quant:recent=32,sinks=4,norm=1"
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from larql.data import default_text
from larql.harness.accuracy.fidelity import greedy_divergence, measure_fidelity, reference_run
from larql.harness.accuracy.report import save_frontier_plot
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate
from larql.kv import parse_engine
from larql.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--positions", type=int, default=None, help="default: the whole text")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--jsonl", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    ids = model.tokenizer.encode(default_text())[: model.config.max_positions]
    if args.positions is not None:
        ids = ids[: args.prompt + args.positions]
    ffn = DenseFfn(model)
    reference = reference_run(model, ffn, parse_engine("standard"), ids, args.prompt)
    standard = parse_engine("standard").build(model)
    greedy = generate(standard, model, ffn, ids[: args.prompt], 64, stop_ids=frozenset()).tokens
    print(f"{args.model}: {len(ids) - args.prompt} positions after a {args.prompt}-token prompt")
    print(
        f"{'spec':58} {'mean KL':>9} {'p99':>8} {'top-1':>7} {'diverge':>7} {'ln PPL':>7} "
        f"{'× fp16':>7} {'s':>5}"
    )
    results = []
    for spec in args.specs:
        t0 = time.perf_counter()
        f = measure_fidelity(model, ffn, parse_engine(spec), ids, args.prompt, reference)
        if f.error:
            print(f"{spec:58} error: {f.error}")
            continue
        f.first_divergence = greedy_divergence(
            model, ffn, parse_engine(spec), ids[: args.prompt], greedy
        )
        f.greedy_steps = len(greedy)
        results.append(f)
        ratio = f.ratio_vs_fp16 or 0.0
        took = time.perf_counter() - t0
        mean = "nan" if math.isnan(f.mean_kl) else f"{f.mean_kl:.4f}"
        diverge = "none" if f.first_divergence is None else str(f.first_divergence)
        print(
            f"{spec:58} {mean:>9} {f.p99_kl:8.3f} {f.same_top1 * 100:6.1f}% {diverge:>7} "
            f"{f.ln_ppl_ratio:7.4f} {ratio:7.3f} {took:5.0f}",
            flush=True,
        )
        if args.jsonl is not None:
            with args.jsonl.open("a") as out:
                out.write(json.dumps({"model": args.model, **f.as_dict()}) + "\n")
    if args.plot is not None:
        title = f"{args.model}: KL against bytes, {len(ids) - args.prompt} positions"
        save_frontier_plot(results, args.plot, title)


if __name__ == "__main__":
    main()
