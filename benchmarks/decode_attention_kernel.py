"""One decode query's attention on a GPU: larql's split-key Triton kernel — its splits merged by
the last of them (one launch) or by a second launch — against torch's fused attention (SDPA)
over the same masked static cache, SmolLM2's heads by default (9 query, 3 K/V, width 64),
bfloat16. Each is timed as replays of a captured CUDA graph of `--layers` calls in a row, one
cache per layer (what a decode step runs: a launch's start is part of its cost), median of
`triton.testing.do_bench_cudagraph`, rounds interleaved; µs a layer and the relative
difference from SDPA.

    python benchmarks/decode_attention_kernel.py [--cases 1024:600,16384:8200] [--layers 30]
        [--heads 9:3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

DIM = 64


def time_case(capacity: int, position: int, heads: int, kv_heads: int, layers: int, rounds: int):
    """One cache depth: each variant's µs a layer (median over interleaved rounds) and the
    kernel's relative difference from SDPA."""
    from triton.testing import do_bench_cudagraph

    from larql.kernels.decode_attention import decode_attention

    scale = DIM**-0.5
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    q = torch.randn(heads, 1, DIM, **kw)
    caches = [torch.randn(2, kv_heads, capacity, DIM, **kw) for _ in range(layers)]
    pos = torch.tensor([position], device="cuda")
    index = torch.arange(capacity, device="cuda")

    def sdpa_one(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        mask = (index <= pos).view(1, -1)  # [1, C], as the static step builds it
        batch = (q[None], keys[None], values[None])
        return F.scaled_dot_product_attention(*batch, attn_mask=mask, scale=scale, enable_gqa=True)[
            0
        ]

    def kernel_one(keys: torch.Tensor, values: torch.Tensor, one_launch: bool) -> torch.Tensor:
        return decode_attention(q, keys, values, pos, scale, one_launch=one_launch)

    def chain(one_launch: bool | None):  # None: SDPA
        def run() -> None:
            for keys, values in caches:
                if one_launch is None:
                    sdpa_one(keys, values)
                else:
                    kernel_one(keys, values, one_launch)

        return run

    reference = sdpa_one(*caches[0]).float()
    variants = {"sdpa": None, "one_launch": True, "two_launches": False}
    row: dict[str, object] = {"capacity": capacity, "position": position, "layers": layers}
    for name in ("one_launch", "two_launches"):
        got = kernel_one(*caches[0], variants[name] is True).float()
        row[f"{name}_relative_difference"] = float((got - reference).norm() / reference.norm())
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, one in variants.items():
            times[name].append(do_bench_cudagraph(chain(one), rep=200) * 1e3 / layers)
    medians = {name: statistics.median(t) for name, t in times.items()}
    row.update({f"{name}_us_per_layer": round(m, 2) for name, m in medians.items()})
    row["one_launch_over_two"] = round(medians["two_launches"] / medians["one_launch"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", default="1024:600,16384:8200", help="capacity:position pairs, comma-separated"
    )
    parser.add_argument("--layers", type=int, default=30, help="calls in a row a graph holds")
    parser.add_argument("--heads", default="9:3", help="query heads:K/V heads (1B shape: 32:8)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds, median")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    heads, kv_heads = (int(x) for x in args.heads.split(":"))
    for case in args.cases.split(","):
        capacity, position = (int(x) for x in case.split(":"))
        row = time_case(capacity, position, heads, kv_heads, args.layers, args.rounds)
        print(json.dumps({"heads": args.heads, **row}), flush=True)


if __name__ == "__main__":
    main()
