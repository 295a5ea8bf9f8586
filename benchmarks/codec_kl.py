"""How far the bf16 cold tier of markov-rs-codec moves the next-token distribution.

Teacher-forces a natural text (the repository's LICENSE by default) through `standard` and
through `markov-rs-codec:window=W` for a few windows, and prints per window the KL divergence
KL(standard ‖ codec) over the forced positions (mean / median / p99 / max, nats) and how often
the two agree on the top-1 token. The contract is mean KL ≤ 0.01 nats over 128
positions on the default model.

    .venv/bin/python benchmarks/codec_kl.py [--windows 4,16,64] [--positions 128]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from larql.inference.ffn import DenseFfn
from larql.inference.generation import teacher_forced_logits
from larql.kv import parse_engine
from larql.models import load_model, parse_dtype

ROOT = Path(__file__).resolve().parents[1]


def kl_per_position(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Logits [N, V] twice → KL(softmax(reference) ‖ softmax(other)) per row [N], nats."""
    log_p = torch.log_softmax(reference.double(), dim=-1)
    log_q = torch.log_softmax(other.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--text", type=Path, default=ROOT / "LICENSE")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--positions", type=int, default=128, help="teacher-forced positions")
    parser.add_argument("--windows", default="4,16,64", help="comma-separated hot windows")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print("$ " + shlex.join([Path(sys.executable).name, *sys.argv]))
    model = load_model(args.model, dtype=parse_dtype(args.dtype))
    ffn = DenseFfn(model)
    ids = model.tokenizer.encode(args.text.read_text())[: args.prompt_len + args.positions - 1]
    print(
        f"model={model.name} dtype={args.dtype} text={args.text.name} "
        f"prompt={args.prompt_len} positions={len(ids) - args.prompt_len + 1}"
    )

    def logits(spec: str) -> torch.Tensor:
        engine = parse_engine(spec).build(model)
        return teacher_forced_logits(engine, model, ffn, ids, args.prompt_len)

    reference = logits("standard")
    print(f"{'engine':<28} {'mean KL':>10} {'median':>10} {'p99':>10} {'max':>10} {'top-1':>7}")
    for window in (int(w) for w in args.windows.split(",")):
        spec = f"markov-rs-codec:window={window}"
        ours = logits(spec)
        kl = kl_per_position(reference, ours)
        top1 = (ours.argmax(-1) == reference.argmax(-1)).double().mean().item()
        print(
            f"{spec:<28} {kl.mean().item():>10.2e} {kl.median().item():>10.2e} "
            f"{kl.quantile(0.99).item():>10.2e} {kl.max().item():>10.2e} {100 * top1:>6.1f}%"
        )


if __name__ == "__main__":
    main()
