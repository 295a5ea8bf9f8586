"""A decode row's products on a GPU: `larql.kernels.gemv`'s folded launches (the norm before,
RoPE after the QKV product, SiLU · up before, the residual add after) against cuBLAS's
`F.linear` alone and against the unfused sequence (for RoPE: the folded norm and product, then
the RoPE launch), at a Llama-3.2-1B layer's matrices (and its LM head) by default, and the
greedy pick over the LM head's logits (torch's argmax against `larql.kernels.argmax`). Each
shape's weight is copied until the copies outgrow the L2 cache, the copies are called in turn
inside a captured CUDA graph, and the time a call is reported with the bandwidth it makes;
`--sweep` also times the launch's block shapes (rows a program, columns a tile, warps) so the
default is chosen by measurement.

    python benchmarks/row_products.py [--hidden 2048] [--intermediate 8192] [--vocab 128256]
        [--qkv 3072] [--kv 512] [--head-dim 64] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from larql.kernels import elementwise, gemv
from larql.kernels.argmax import argmax_rows

L2_COPIES_BYTES = 128 * 2**20  # more than an H200's 50 MB of L2


def graph_time_us(fn: Callable[[], None], replays: int = 20) -> float:
    """µs per replay of `fn` captured once in a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / replays


def calls(
    kind: str,
    weights: list[torch.Tensor],
    row: torch.Tensor,
    gate_up: torch.Tensor,
    norm: torch.Tensor,
    residual: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor, int, int],
) -> dict[str, Callable[[], None]]:
    """The three ways to compute `kind` ("normed", "rope" — normed, then RoPE over the first
    heads —, "residual", "gated") over every copy."""
    gate, up = gate_up.chunk(2, dim=-1)
    cos, sin, rotated_heads, head_dim = rope

    def cublas() -> None:
        for w in weights:
            F.linear(row, w)

    def unfused() -> None:
        for w in weights:
            if kind == "normed":
                F.linear(elementwise.rms_norm(row, norm, 1e-5), w)
            elif kind == "rope":
                qkv = gemv.normed_gemv(row, norm, 1e-5, w)  # the launch RoPE was beside
                qk = qkv[:, : rotated_heads * head_dim].view(rotated_heads, 1, head_dim)
                elementwise.rope(qk, cos, sin)
            elif kind == "residual":
                residual + F.linear(row, w)
            else:
                residual + F.linear(elementwise.silu_mul(gate, up), w)

    def folded() -> None:
        for w in weights:
            if kind == "normed":
                gemv.normed_gemv(row, norm, 1e-5, w)
            elif kind == "rope":
                gemv.normed_gemv_rope(row, norm, 1e-5, w, None, cos, sin, rotated_heads, head_dim)
            elif kind == "residual":
                gemv.residual_gemv(residual, row, w)
            else:
                gemv.gated_residual_gemv(residual, gate_up, w)

    return {"cublas": cublas, "unfused": unfused, "folded": folded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--qkv", type=int, default=3072, help="rows of the fused QKV product")
    parser.add_argument("--kv", type=int, default=512, help="K (and V) rows of the QKV product")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--sweep", action="store_true", help="also time other block shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    h, f = args.hidden, args.intermediate
    products = {  # name: (N, K, what is folded in)
        "qkv": (args.qkv, h, "normed"),
        "qkv_rope": (args.qkv, h, "rope"),
        "output": (h, h, "residual"),
        "gate_up": (2 * f, h, "normed"),
        "down": (h, f, "gated"),
        "lm_head": (args.vocab, h, "normed"),
    }
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = [torch.randn(1, args.vocab, generator=generator, device="cuda").bfloat16()] * 16
    torch_pick = graph_time_us(lambda: [torch.argmax(row[0]) for row in logits]) / 16
    kernel_pick = graph_time_us(lambda: [argmax_rows(row) for row in logits]) / 16
    print(f"pick [1 x {args.vocab}] bf16: torch {torch_pick:.2f} us, kernel {kernel_pick:.2f} us")
    default_shape = gemv._shape
    rotated_heads = (args.qkv - args.kv) // args.head_dim  # q and k
    angles = torch.rand(1, args.head_dim // 2, device="cuda") * 6.28
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(torch.bfloat16)
    sin = torch.cat((-angles.sin(), angles.sin()), dim=-1).to(torch.bfloat16)
    rope = (cos, sin, rotated_heads, args.head_dim)
    print("| product [N x K] | cuBLAS us | unfused us | folded us | folded TB/s | shape |")
    print("|---|---|---|---|---|---|")
    for name, (n, k, kind) in products.items():
        copies = max(1, -(-L2_COPIES_BYTES // (n * k * 2)))
        kw = {"device": "cuda", "dtype": torch.bfloat16}
        weights = [torch.randn(n, k, generator=generator, **kw) / k**0.5 for _ in range(copies)]
        row = torch.randn(1, k, generator=generator, **kw)
        gate_up = torch.randn(1, 2 * k, generator=generator, **kw)
        norm = 1 + torch.rand(k, generator=generator, **kw)
        residual = torch.randn(1, n, generator=generator, **kw)
        ways = calls(kind, weights, row, gate_up, norm, residual, rope)
        us = {way: graph_time_us(fn) / copies for way, fn in ways.items()}
        tb_s = n * k * 2 / (us["folded"] * 1e-6) / 1e12
        print(
            f"| {name} [{n} x {k}] | {us['cublas']:.2f} | {us['unfused']:.2f} | "
            f"{us['folded']:.2f} | {tb_s:.2f} | {default_shape(n, k)} |"
        )
        if args.sweep and kind != "rope":  # its rows come in pairs: the shape of `normed`
            timed = []
            shapes = itertools.product([1, 2, 4, 8], [512, 1024, 2048, 4096, 8192], [4, 8])
            for rows, cols, warps in shapes:
                if rows * cols > 32768 or cols > triton.next_power_of_2(k):
                    continue
                gemv._shape = lambda out_features, in_features: (rows, cols, warps)  # noqa: B023
                timed.append((graph_time_us(ways["folded"]) / copies, rows, cols, warps))
            gemv._shape = default_shape
            for t, rows, cols, warps in sorted(timed)[:5]:
                print(f"|   {rows} rows, {cols} columns, {warps} warps | | | {t:.2f} | | |")
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
