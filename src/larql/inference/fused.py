"""The compiled decode-step pieces (`larql.kernels.cpu`: fused QKV + RoPE, output projection +
residual, the whole gated MLP + residual) where one row runs through them: a float32 row on the
CPU whose matrices the model holds in GGUF blocks. `layer.py` asks here first and otherwise
runs the torch operators, which stay the reference the pieces are tested against."""

from __future__ import annotations

from types import ModuleType

import torch

from larql.kernels.cpu.build import load as load_block_kernels
from larql.models.blocks import FORMAT_CODES, BlockRows


def fused_kernels(h: torch.Tensor) -> ModuleType | None:
    """The extension when the residual h: [S, H] is one float32 row on the CPU, else None."""
    if h.shape[0] != 1 or h.dtype != torch.float32 or h.device.type != "cpu":
        return None
    if h.requires_grad or torch.compiler.is_compiling():
        return None
    return load_block_kernels()


def code(blocks: BlockRows) -> int:
    """The extension's `format` argument for these blocks."""
    return FORMAT_CODES[blocks.format]
