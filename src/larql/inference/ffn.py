"""The FFN side of a layer, behind one protocol so engines never care how it is computed.

An `FfnBackend` takes the *pre-FFN-normed* residual of one layer and returns the raw FFN output;
the caller applies the post-FFN norm (if any) and the residual add (`layer.ffn_block`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from larql.errors import LarqlError
from larql.models.model import Model


@runtime_checkable
class FfnBackend(Protocol):
    name: str

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x: [S, H] pre-FFN-normed → FFN output [S, H]."""
        ...


def gated_activation(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    return F.gelu(gate)


class DenseFfn:
    """The model's own gated MLP: down(act(gate·x) ⊙ up·x), gate and up in one matmul."""

    name = "dense"

    def __init__(self, model: Model) -> None:
        self._layers = model.weights.layers
        self._activation = model.config.arch.activation

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        lw = self._layers[layer]
        gate, up = F.linear(x, lw.w_gate_up).chunk(2, dim=-1)  # [S, F] each
        return F.linear(gated_activation(gate, self._activation) * up, lw.w_down)


class UnknownFfnBackend(LarqlError):
    """An FFN spec that names no backend."""


FFN_BACKENDS = {"dense": ("dense", "weight", "weights")}


def build_ffn(model: Model, spec: str = "dense") -> FfnBackend:
    """The FFN backend a spec names (only `dense` so far)."""
    name = spec.strip().lower()
    if name in FFN_BACKENDS["dense"]:
        return DenseFfn(model)
    raise UnknownFfnBackend(f"unknown FFN backend {spec!r}; supported: {', '.join(FFN_BACKENDS)}")
