"""The FFN side of a layer, behind one protocol so engines never care how it is computed.

An `FfnBackend` takes the *pre-FFN-normed* residual of one layer and returns the raw FFN output;
the caller applies the post-FFN norm (if any) and the residual add (`layer.ffn_block`).

The backends a policy can name live next to this module: `DenseFfn` and `NullFfn` here,
`WalkFfn` in `ffn_walk`, `RemoteWalkFfn` in `ffn_remote`; `ffn_policy` parses the per-layer
policy grammar and builds the router (itself an `FfnBackend`) that `build_ffn` returns.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from larql.inference.linear import linear
from larql.models.model import Model


@runtime_checkable
class FfnBackend(Protocol):
    """A backend may also say `graph_safe = True`: its forward launches only device work with
    static shapes, so a decode step that calls it can be captured in a CUDA graph."""

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
    graph_safe = True

    def __init__(self, model: Model) -> None:
        self._layers = model.weights.layers
        self._activation = model.config.arch.activation

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        lw = self._layers[layer]
        gate, up = linear(x, lw.w_gate_up).chunk(2, dim=-1)  # [S, F] each
        return linear(gated_activation(gate, self._activation) * up, lw.w_down)


class NullFfn:
    """The FFN ablated: it contributes nothing, so the layer is attention only (DESIGN
    decision 6 — zeros, not the identity; a post-FFN norm of zeros is still zero)."""

    name = "null"
    graph_safe = True

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)  # [S, H]


def build_ffn(model: Model, spec: str = "dense") -> FfnBackend:
    """The FFN a policy spec names (`dense`, `walk:k=100`,
    `{walk:k=100}@layers=14-27;{dense}@otherwise`, …), validated against the model's depth
    and built as a per-layer router. Errors are the typed `FfnPolicyError`s of `ffn_policy`."""
    from larql.inference.ffn_policy import FfnLayerPolicy  # the policy module builds on this one

    return FfnLayerPolicy.from_spec(spec).validate_for(model.config.num_layers).build_router(model)
