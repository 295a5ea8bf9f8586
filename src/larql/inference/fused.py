"""The compiled decode-step pieces (`larql.kernels.cpu`) where a few float32 rows on the CPU
(a decode step, a batched one, a prompt: up to `block_rows(activation)`) run through them:
fused QKV + RoPE, output projection + residual and the whole gated MLP + residual for matrices
the model holds in GGUF blocks, and one query's attention over float32 K/V rows (any model).
`layer.py` asks here first and otherwise runs the torch operators, which stay the reference the
pieces are tested against."""

from __future__ import annotations

from types import ModuleType

import torch

from larql.inference.linear import block_rows
from larql.kernels.cpu.build import load as load_block_kernels
from larql.models.blocks import ACTIVATION_BITS, BlockRows


def fused_kernels(h: torch.Tensor, blocks: BlockRows | None = None) -> ModuleType | None:
    """The extension when the residual h: [S, H] is float32 rows on the CPU, no more than the
    block products of `blocks` take (`block_rows`; one row where no blocks are given), else
    None."""
    limit = 1 if blocks is None else block_rows(blocks.activation)
    if h.shape[0] > limit or h.dtype != torch.float32 or h.device.type != "cpu":
        return None
    if h.requires_grad or torch.compiler.is_compiling():
        return None
    return load_block_kernels()


def attention_kernels(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> ModuleType | None:
    """The extension when q: [Hq, 1, D] is one float32 query on the CPU over float32 K/V
    rows [Hkv, T, D] with unit stride over D, else None."""
    if q.shape[1] != 1 or keys.dtype != torch.float32 or values.dtype != torch.float32:
        return None
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        return None
    return fused_kernels(q[0])


def activation_bits(blocks: BlockRows) -> int:
    """The extension's `activation_bits` argument for these blocks."""
    return ACTIVATION_BITS[blocks.activation]
