"""`linear`: `F.linear`, except for the one-row products of a decode step on the CPU.

MKL runs a one-row float32/float64 product (a GEMV) on a single core: 16 GB/s on the project's
2-core machine, where the memory system delivers ~38 GB/s to two cores (the float16 GEMV gets
there). Split into a batched product over `threads` row blocks, MKL runs one block per core:
SmolLM2's 30 layers go from 26 to 11 ms per token in float32 (benchmarks in
docs/PERFORMANCE.md). bfloat16/float16 and everything on a GPU keep `F.linear`, which is
already fast there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_SPLIT_DTYPES = (torch.float32, torch.float64)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [S, in] @ weight[out, in]ᵀ (+ bias) → [S, out]."""
    if torch.compiler.is_compiling() or x.device.type != "cpu" or x.shape[0] != 1:
        # decided before asking for the thread count, which torch.compile cannot trace: a
        # compiled step must not break its graph here (a compiler fuses the product itself)
        return F.linear(x, weight, bias)
    blocks = torch.get_num_threads()
    out_features, in_features = weight.shape
    if (
        not x.is_contiguous()
        or blocks < 2
        or weight.dtype not in _SPLIT_DTYPES
        or out_features % blocks
        or not weight.is_contiguous()
    ):
        return F.linear(x, weight, bias)
    stacked = weight.view(blocks, out_features // blocks, in_features)  # [B, out/B, in]
    # x.t() keeps a BLAS-compatible leading dimension; a [in, 1] reshape (strides 1, 1) sends
    # bmm to a slow non-BLAS loop (10x).
    column = x.t().expand(blocks, in_features, 1)  # [B, in, 1]
    out = torch.bmm(stacked, column).view(1, out_features)  # [1, out]
    return out if bias is None else out + bias
