"""The compiled decode-step pieces (`larql.kernels.cpu`) where a few float32 rows on the CPU
(a decode step, a batched one, a prompt: up to `block_rows(activation)`) run through them:
fused QKV + RoPE, output projection + residual and the whole gated MLP + residual for matrices
the model holds in GGUF blocks, and one query's attention over float32 K/V rows (any model).
`layer.py` asks here first and otherwise runs the torch operators, which stay the reference the
pieces are tested against."""

from __future__ import annotations

import torch

from larql.inference.linear import block_rows
from larql.models.blocks import ACTIVATION_BITS, BlockRows


def takes_fused(h: torch.Tensor, blocks: BlockRows | None = None) -> bool:
    """Whether the residual h: [S, H] goes through the extension's pieces (where
    `cpu_extension()` has it): float32 rows on the CPU, no more than the block products of
    `blocks` take (`block_rows`; one row where no blocks are given), outside autograd and
    compilers."""
    limit = 1 if blocks is None else block_rows(blocks.activation)
    if h.shape[0] > limit or h.dtype != torch.float32 or h.device.type != "cpu":
        return False
    return not (h.requires_grad or torch.compiler.is_compiling())


def takes_fused_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether q: [Hq, 1, D], one float32 query on the CPU over float32 K/V rows [Hkv, T, D]
    with unit stride over D, goes through the extension's attention."""
    if q.shape[1] != 1 or keys.dtype != torch.float32 or values.dtype != torch.float32:
        return False
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        return False
    return takes_fused(q[0])


def activation_bits(blocks: BlockRows) -> int:
    """The extension's `activation_bits` argument for these blocks."""
    return ACTIVATION_BITS[blocks.activation]
