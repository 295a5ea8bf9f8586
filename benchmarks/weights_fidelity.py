"""What each `--weights` mode changes: its decode against the float32 weights' decode.

The block modes only change one-row products (prefill runs BLAS on the float weights); the
load-time modes `q8_0` / `q4_0` change the weights themselves (prefill's too), so for them this
measures the quantisation plus the int16 products, against `float`: the file's own weights, for
a quantised GGUF its dequantised ones (SmolLM2's Q4_1, re-quantised by `q8_0` / `q4_0`). The
comparison feeds the text one token at a time: after a `--prompt-len` prefill, every next token
of the shipped text goes through `decode_step` (teacher-forced), and each mode's next-token
logits are compared with `--weights float`'s at the same position: KL(float ‖ mode) (mean /
p99 / max, nats), how often the top-1 token agrees, and the ln-perplexity of the text under
each. Then each mode decodes greedily from the prompt, and the first step whose token differs
from the float path's is reported (— when none does).

    .venv/bin/python benchmarks/weights_fidelity.py [--modes blocks-float,blocks-int8,q8_0]
        [--prompt-len 32] [--positions 512] [--greedy 64] [--text FILE]
        [--head-activation int8]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from larql.data import default_text
from larql.inference.ffn import DenseFfn
from larql.inference.generation import next_token_logits, teacher_forced_hidden
from larql.kv import parse_engine
from larql.models import Model, load_model


def kl_per_position(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Logits [N, V] twice → KL(softmax(reference) ‖ softmax(other)) per row [N], nats."""
    log_p = torch.log_softmax(reference.double(), dim=-1)
    log_q = torch.log_softmax(other.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def ln_perplexity(logits: torch.Tensor, targets: list[int]) -> float:
    """Mean negative log-likelihood of `targets` under logits [N, V] (row i predicts i)."""
    log_p = torch.log_softmax(logits.double(), dim=-1)
    return -log_p[torch.arange(len(targets)), torch.tensor(targets)].mean().item()


def greedy(model: Model, prompt: list[int], steps: int) -> list[int]:
    ffn, engine = DenseFfn(model), parse_engine("standard").build(model)
    token = int(next_token_logits(model, engine.prefill(model, ffn, prompt)).argmax())
    tokens = []
    for _ in range(steps):
        tokens.append(token)
        token = int(next_token_logits(model, engine.decode_step(model, ffn, token)).argmax())
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--modes", default="blocks-float,blocks-int8")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--positions", type=int, default=512, help="teacher-forced positions")
    parser.add_argument("--greedy", type=int, default=64, help="greedy steps compared")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--text", type=Path, help="a text file (default: the shipped text)")
    parser.add_argument(
        "--head-activation",
        choices=("int8", "int16"),
        help="the block modes' LM-head inputs instead of their own (what the head alone adds)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("$ " + shlex.join([Path(sys.executable).name, *sys.argv]))

    def run(weights: str) -> tuple[torch.Tensor, list[int], list[int]]:
        """→ teacher-forced logits [N, V], their targets [N], greedy tokens [--greedy]."""
        model = load_model(args.model, weights=weights)
        head = model.weights.lm_head_blocks
        if args.head_activation and head is not None:
            head.activation = args.head_activation
        text = args.text.read_text() if args.text else default_text()
        ids = model.tokenizer.encode(text)[: args.prompt_len + args.positions]
        engine = parse_engine("standard").build(model)
        with torch.inference_mode():
            # each position's head product alone, as a decode step takes it (a product of many
            # rows may take another path: the float matrix past `linear.block_rows`)
            hidden = teacher_forced_hidden(engine, model, DenseFfn(model), ids, args.prompt_len)
            logits = torch.stack([next_token_logits(model, row) for row in hidden])  # [N + 1, V]
            tokens = greedy(model, ids[: args.prompt_len], args.greedy)
        return logits[:-1], ids[args.prompt_len :], tokens  # row i predicts target i

    reference, targets, float_tokens = run("float")
    print(f"model={args.model} prompt={args.prompt_len} positions={len(targets)} dtype=float32")
    print(
        f"{'weights':<14} {'mean KL':>9} {'p99':>9} {'max':>9} {'top-1':>7} {'ln PPL':>8} "
        f"{'greedy ≠ at':>12}"
    )
    print(
        f"{'float':<14} {'—':>9} {'—':>9} {'—':>9} {'—':>7} "
        f"{ln_perplexity(reference, targets):>8.4f} {'—':>12}"
    )
    for mode in args.modes.split(","):
        logits, _, tokens = run(mode)
        kl = kl_per_position(reference, logits)
        top1 = (logits.argmax(-1) == reference.argmax(-1)).double().mean().item()
        pairs = enumerate(zip(tokens, float_tokens, strict=True))
        differ = next((i for i, (a, b) in pairs if a != b), None)
        print(
            f"{mode:<14} {kl.mean().item():>9.2e} {kl.quantile(0.99).item():>9.2e} "
            f"{kl.max().item():>9.2e} {100 * top1:>6.1f}% {ln_perplexity(logits, targets):>8.4f} "
            f"{'—' if differ is None else differ:>12}"
        )


if __name__ == "__main__":
    main()
