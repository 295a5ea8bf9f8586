"""The activation of a gated MLP's gate, by the name an architecture gives it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from larql.kernels import elementwise_kernels


def gated_activation(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    return F.gelu(gate)


def gated_product(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) · up: [S, F] each → [S, F]; SiLU's in one launch on CUDA."""
    if activation == "silu" and (kernels := elementwise_kernels(gate)) is not None:
        return kernels.silu_mul(gate, up)
    return gated_activation(gate, activation) * up
