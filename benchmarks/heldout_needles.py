"""Needles in a haystack the suites never ship: a plain-text file given on the command line (a
licence text, say), three facts inserted at 20%, 50% and 80% of it, compressed before any
question is seen, then each fact asked on its own copy of the compressed context (the ruler
suite's compress-then-ask path, `larql.harness.ruler.run.score_sample`).

    .venv/bin/python benchmarks/heldout_needles.py /usr/share/common-licenses/GPL-3 \\
        --tokens 2177 --engines "standard;turbo-quant:bits=4;snapkv:keep=0.5"

Prints one row per engine: the facts found (of 3), the state's bytes after the context, and
each answer's text. The needles' numbers come from `--seed`.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from larql.harness.ruler.run import score_sample
from larql.harness.ruler.tasks import Query, Sample
from larql.inference.ffn import build_ffn
from larql.kv.catalog import parse_engine
from larql.models import load_model

KEYS = ("the harbour", "the orchard", "the observatory")
DEPTHS = (0.2, 0.5, 0.8)


def haystack_sample(text: str, tokens: int, tokenizer, seed: int) -> Sample:
    """The first `tokens` tokens of `text` (cut on a line), each key's fact at its depth."""
    rng = random.Random(seed)
    lines = text.splitlines(keepends=True)
    kept: list[str] = []
    for line in lines:
        if len(tokenizer.encode("".join([*kept, line]))) > tokens - 60:
            break
        kept.append(line)
    numbers = [str(rng.randrange(1_000_000, 10_000_000)) for _ in KEYS]
    for depth, key, number in sorted(zip(DEPTHS, KEYS, numbers, strict=True), reverse=True):
        at = int(depth * len(kept))
        kept.insert(at, f"\nThe special magic number for {key} is: {number}.\n")
    queries = tuple(
        Query(
            f"\n\nWhat is the special magic number for {key}? "
            f'The special magic number for {key} is "',
            (number,),
            12,
        )
        for key, number in zip(KEYS, numbers, strict=True)
    )
    return Sample("held-out-needles", tokens, 0, "".join(kept), queries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("haystack", type=Path, help="a plain-text file")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2177, help="the context's size")
    parser.add_argument("--engines", default="standard")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    model = load_model(args.model, device=args.device, weights="float")
    sample = haystack_sample(args.haystack.read_text(), args.tokens, model.tokenizer, args.seed)
    ffn = build_ffn(model, "dense")
    print(f"context: {len(model.tokenizer.encode(sample.context))} tokens")
    print("| engine | found (of 3) | KiB held | answers |")
    print("|---|---|---|---|")
    for spec in (s for s in args.engines.split(";") if s):
        cell = score_sample(model, ffn, parse_engine(spec), sample)
        if cell.error:
            print(f"| `{spec}` | error | | {cell.error} |")
            continue
        found = round(cell.score * len(sample.queries))
        shown = " / ".join(repr(t) for t in cell.predicted)
        print(f"| `{spec}` | {found} | {cell.memory_bytes / 1024:,.0f} | {shown} |")


if __name__ == "__main__":
    main()
