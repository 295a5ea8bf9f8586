"""One decode query's attention on a GPU: larql's split-key Triton kernel against torch's fused
attention (SDPA) over the same masked static cache, SmolLM2's heads (9 query, 3 K/V, width 64),
bfloat16. Each is timed as replays of a captured CUDA graph (what the fast path runs), median
of `triton.testing.do_bench_cudagraph`, with random data and the relative difference reported.

    python benchmarks/decode_attention_kernel.py [--cases 1024:600,16384:8200]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, DIM = 9, 3, 64
SCALE = DIM**-0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", default="1024:600,16384:8200", help="capacity:position pairs, comma-separated"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    from triton.testing import do_bench_cudagraph

    from larql.kernels.decode_attention import decode_attention

    rows = []
    for case in args.cases.split(","):
        capacity, position = (int(x) for x in case.split(":"))
        kw = {"device": "cuda", "dtype": torch.bfloat16}
        q = torch.randn(HEADS, 1, DIM, **kw)
        keys, values = torch.randn(2, KV_HEADS, capacity, DIM, **kw)
        pos = torch.tensor([position], device="cuda")
        index = torch.arange(capacity, device="cuda")

        def sdpa(q=q, keys=keys, values=values, pos=pos, index=index):
            mask = (index <= pos).view(1, -1)  # [1, C], as the static step builds it
            batch = (q[None], keys[None], values[None])
            return F.scaled_dot_product_attention(
                *batch, attn_mask=mask, scale=SCALE, enable_gqa=True
            )[0]

        def triton(q=q, keys=keys, values=values, pos=pos):
            return decode_attention(q, keys, values, pos, SCALE)

        reference = sdpa().float()
        difference = (triton().float() - reference).norm() / reference.norm()
        row = {
            "capacity": capacity,
            "position": position,
            "sdpa_us": do_bench_cudagraph(sdpa, rep=200) * 1e3,
            "triton_us": do_bench_cudagraph(triton, rep=200) * 1e3,
            "relative_difference": float(difference),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
