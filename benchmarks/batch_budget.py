"""How much of the 4× budget a batched CPU decode step's products take.

Eight streams deliver 4× one stream's tokens only when an eight-row step takes at most twice
one row's step (8 / T8 ≥ 4 / T1). One row's step is bound by reading the weights; the eight
rows' by multiplying them. In rounds in turn, in process (no server), this times:

- one `standard` session's decode step (`GenerationSession.step`) and B sessions stepped
  together (`step_together`, as `larql serve` steps them), every session on the issue's
  check prompt (`Story i: Once upon a time`);
- the products alone: every block matrix of the model (each layer's and the LM head) through
  the compiled block product for 1 and for B rows of random inputs, each matrix its own call.

It prints, per round, the fastest and the median step of each kind, the ratio B · T1 / TB of the
medians, and the B-row products' share of the budget (B / 4 × T1 for the issue's 4× at B = 8).

    .venv/bin/python benchmarks/batch_budget.py [--batch 8] [--rounds 4] [--steps 40]
        [--threads 2] [--weights auto] [--target 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import larql
from larql.inference.ffn.backend import DenseFfn
from larql.inference.generation import GenerationSession, step_together
from larql.inference.linear import kernel_rows
from larql.kernels.cpu import cpu_extension
from larql.models.blocks import ACTIVATION_BITS
from larql.models.model import Model

WARMUP_STEPS = 3


def timed(fn: Callable[[], object], times: int) -> list[float]:
    """ms of each of `times` calls of `fn`."""
    spans = []
    for _ in range(times):
        start = time.perf_counter()
        fn()
        spans.append((time.perf_counter() - start) * 1000)
    return spans


def session_steps(model: Model, sessions: int, steps: int) -> list[float]:
    """ms of each decode step of `sessions` `standard` sessions (one: stepped alone)."""
    ffn, spec = DenseFfn(model), larql.parse_engine("standard")
    prompts = [model.tokenizer.encode(f"Story {i}: Once upon a time") for i in range(sessions)]
    group = [
        GenerationSession(spec.build(model), model, ffn, ids, steps + WARMUP_STEPS + 1)
        for ids in prompts
    ]
    for session in group:
        session.prefill()
    step = group[0].step if sessions == 1 else lambda: step_together(group)
    timed(step, WARMUP_STEPS)
    return timed(step, steps)


def product_passes(model: Model, rows: int, passes: int) -> list[float]:
    """ms of each pass of the compiled block product over every block matrix, `rows` rows."""
    kernels = cpu_extension()
    if kernels is None:
        raise SystemExit("the compiled CPU kernels are not built: run `make setup`")
    matrices = [b for layer in model.weights.layers for b in layer.blocks.values()]
    if model.weights.lm_head_blocks is not None:
        matrices.append(model.weights.lm_head_blocks)
    calls = []
    for blocks in matrices:
        data, code = kernel_rows(blocks, kernels)
        x = torch.randn(rows, blocks.in_features)  # [rows, in]
        calls.append((x, data, code, ACTIVATION_BITS[blocks.activation]))

    def one_pass() -> None:
        for args in calls:
            kernels.block_gemm(*args)

    timed(one_pass, 1)
    return timed(one_pass, passes)


def report(model: Model, batch: int, rounds: int, steps: int, target: float) -> list[str]:
    """One line a round (see the module's docstring), printed as it is measured."""
    lines = []
    with torch.inference_mode():
        for round_ in range(rounds):
            one = session_steps(model, 1, steps)
            many = session_steps(model, batch, steps)
            p_one = product_passes(model, 1, max(1, steps // 4))
            p_many = product_passes(model, batch, max(1, steps // 4))
            t1, tb = statistics.median(one), statistics.median(many)
            budget = batch / target * t1
            lines.append(
                f"round {round_}: step 1 row {min(one):.2f} / {t1:.2f} ms (fastest / median), "
                f"{batch} rows {min(many):.2f} / {tb:.2f} ms: {batch * t1 / tb:.2f}x | "
                f"products alone 1 row {statistics.median(p_one):.2f} ms, {batch} rows "
                f"{statistics.median(p_many):.2f} ms = "
                f"{statistics.median(p_many) / budget:.2f} of the {target:g}x budget "
                f"({budget:.2f} ms)"
            )
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="sessions stepped together")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40, help="timed steps a measurement")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--target", type=float, default=4.0, help="the ratio the budget is for")
    args = parser.parse_args()
    model = larql.load_model(weights=args.weights, threads=args.threads)
    print(f"{model.name}, --weights {args.weights}, {args.threads} threads, B = {args.batch}")
    report(model, args.batch, args.rounds, args.steps, args.target)


if __name__ == "__main__":
    main()
