"""The activation of a gated MLP's gate, by the name an architecture gives it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_activation(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    return F.gelu(gate)
