"""Which matrices' inputs can be rounded to int8: a simulation on the float path.

The block products round each input row per block of 32 to integer codes (scale max|x| / L) and
multiply the codes. This script rounds the inputs of one kind of matrix at a time (or all of
them) in torch, in front of the float product with the model's dequantised weights
(`--weights float`), and compares the next-token distributions with the unrounded float path's
over the shipped text, teacher-forced after a 32-token prompt: mean / p99 KL (nats) and how
often the top-1 token agrees. A matrix kind is named by its weight's shape (`960x576`: SmolLM2's
QKV; `3072x576`: gate/up; `576x576`: the output projection; `576x1536`: down; `49152x576`: the
LM head) or `all`. Schemes: `int8`, `int16` (levels 127 / 32,767), `hybrid:T` (int16 codes,
rounded on to int8 steps in every block whose max is at most T times its RMS).

The rounding is swapped in for the float path's `linear` in the modules that call it; nothing
in larql changes. The real kernels' int8 arithmetic is `weights_fidelity.py`'s `blocks-int8`.

    .venv/bin/python benchmarks/input_rounding.py [--positions 512]
        [--schemes all@int8,960x576@int8,3072x576@int8,576x576@int8,576x1536@int8,49152x576@int8]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import larql.inference.ffn.backend as ffn_backend
import larql.inference.layer as layer_module
import larql.inference.linear as linear_module
import larql.inference.row_products as row_products
from larql.data import default_text
from larql.inference.ffn import DenseFfn
from larql.inference.generation import teacher_forced_logits
from larql.kv import parse_engine
from larql.models import load_model

CALLERS = (layer_module, ffn_backend, row_products)  # the modules that import `linear`
SCHEMES = (
    "all@int8,960x576@int8,3072x576@int8,576x576@int8,576x1536@int8,49152x576@int8,all@hybrid:3"
)


def rounded(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """x: [S, K] → x with each block of 32 rounded by `scheme` (int8, int16, hybrid:T)."""
    rows, width = x.shape
    blocks = x.float().reshape(rows, width // 32, 32)  # [S, K/32, 32]
    top = blocks.abs().amax(-1, keepdim=True)  # [S, K/32, 1]
    levels = 127 if scheme == "int8" else 32767
    step = top / levels
    codes = torch.round(blocks / torch.where(step > 0, step, 1)).clamp(-levels, levels)
    if scheme.startswith("hybrid:"):
        narrow = top <= float(scheme.split(":")[1]) * blocks.pow(2).mean(-1, keepdim=True).sqrt()
        codes = torch.where(narrow, torch.round(codes / 256).clamp(-128, 127) * 256, codes)
    elif scheme not in ("int8", "int16"):
        raise SystemExit(f"unknown scheme {scheme!r}: int8, int16 or hybrid:T")
    return (codes * step).reshape(rows, width).to(x.dtype)


def rounding_linear(kind: str, scheme: str | None) -> Callable[..., torch.Tensor]:
    """`linear` with the inputs of `kind` matrices (a weight shape like 960x576, or all)
    rounded by `scheme` first (None: unchanged)."""
    original = linear_module.linear

    def linear(x, weight, bias=None, blocks=None):  # type: ignore[no-untyped-def]
        shape = "x".join(str(n) for n in weight.shape)
        if scheme is not None and kind in ("all", shape):
            x = rounded(x, scheme)
        return original(x, weight, bias, blocks)

    return linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--positions", type=int, default=512)
    parser.add_argument("--schemes", default=SCHEMES, help="KIND@SCHEME, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("$ " + shlex.join([Path(sys.executable).name, *sys.argv]))
    model = load_model(args.model, weights="float")
    ids = model.tokenizer.encode(default_text())[: 32 + args.positions]

    def logits(kind: str, scheme: str | None) -> torch.Tensor:
        """Teacher-forced next-token logits [N, V] with `kind`'s inputs rounded."""
        patched = rounding_linear(kind, scheme)
        for module in CALLERS:
            module.linear = patched  # type: ignore[attr-defined]
        try:
            engine = parse_engine("standard").build(model)
            with torch.inference_mode():
                return teacher_forced_logits(engine, model, DenseFfn(model), ids, 32)[:-1]
        finally:
            for module in CALLERS:
                module.linear = linear_module.linear  # type: ignore[attr-defined]

    reference = torch.log_softmax(logits("all", None).double(), dim=-1)
    print(f"model={args.model} positions={reference.shape[0]} (the float path as reference)")
    print(f"{'inputs rounded':<22} {'mean KL':>9} {'p99':>9} {'top-1':>7}")
    for item in args.schemes.split(","):
        kind, _, scheme = item.partition("@")
        other = torch.log_softmax(logits(kind, scheme).double(), dim=-1)
        kl = (reference.exp() * (reference - other)).sum(-1)  # [N]
        same = (other.argmax(-1) == reference.argmax(-1)).double().mean().item()
        print(
            f"{item:<22} {kl.mean().item():>9.2e} {kl.quantile(0.99).item():>9.2e} "
            f"{100 * same:>6.1f}%"
        )


if __name__ == "__main__":
    main()
