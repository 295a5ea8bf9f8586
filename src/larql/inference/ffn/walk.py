"""`walk`: the FFN computed feature by feature instead of by dense matmuls.

A feature f of layer ℓ is one intermediate neuron: its gate row, its up row and its down column.
The walk scores every feature's gate against the normed residual, keeps the k features with the
largest |activated gate|, and computes up and down only for those:

    out = Σ_{f ∈ top-k} act(gate_f · x) · (up_f · x) · down_f

With k absent (or k ≥ the number of features) every feature is kept, and the walk takes the
dense code path itself — bit-identical to `DenseFfn`, not merely close.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from larql.inference.ffn.activation import gated_activation
from larql.inference.ffn.backend import DenseFfn, FfnBackend
from larql.inference.ffn.spec import FfnPolicyError
from larql.models.model import Model

# Rows of a prefill gathered at once: bounds the [rows, k, H] gather buffers.
_GATHER_ELEMENTS = 1 << 22


def select_features(activated_gate: torch.Tensor, k: int) -> torch.Tensor:
    """activated_gate: [S, F] → the k features with the largest |activation| per row, [S, k]."""
    return activated_gate.abs().topk(k, dim=-1).indices


def down_rows(model: Model, layer: int) -> torch.Tensor:
    """Layer's down projection feature-major, [F, H] contiguous: row f is feature f's down
    vector (a feature-major layout), so a walk reads k whole rows instead of k
    strided columns. Built on first use and kept in `model.runtime`, shared by every walk."""
    key = ("walk_down_rows", layer, model.dtype, model.device)
    rows = model.runtime.get(key)
    if rows is None:
        rows = model.runtime[key] = model.weights.layers[layer].w_down.t().contiguous()
    return rows  # type: ignore[return-value]


class WalkFfn(FfnBackend):
    """Top-k sparse FFN; `k=None` is the dense-equivalent walk."""

    kind = "walk"

    def __init__(self, model: Model, k: int | None = None) -> None:
        if k is not None and k < 1:
            raise ValueError(f"walk k must be ≥ 1, got {k}")
        experts = [i for i, lw in enumerate(model.weights.layers) if lw.w_gate_up is None]
        if k is not None and experts:
            raise FfnPolicyError(
                f"walk:k={k} keeps the top features of a dense MLP; layer {experts[0]} of this "
                "model is a mixture of experts with none (use walk or dense there)"
            )
        self.k = k
        self.name = "walk" if k is None else f"walk:k={k}"
        self._model = model
        self._dense = DenseFfn(model)
        self._activation = model.config.arch.activation
        cfg = model.config
        self._features = max(cfg.intermediate_size_of(i) for i in range(cfg.num_layers))

    @property
    def is_dense(self) -> bool:
        return self.k is None or self.k >= self._features  # the widest layer's count

    @property
    def graph_safe(self) -> bool:  # type: ignore[override]
        return self.is_dense  # the sparse path builds feature-major copies on first use

    def parallel_experts(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return self._dense.parallel_experts(layer, h)  # the walk keeps the MLP's features only

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if self.is_dense:
            return self._dense.forward(layer, x)
        assert self.k is not None
        w_gate_up = self._model.weights.layers[layer].w_gate_up
        n = w_gate_up.shape[0] // 2  # this layer's features (Gemma 4's may be double-wide)
        w_gate, w_up = w_gate_up[:n], w_gate_up[n:]  # [F, H] each (views)
        w_down = down_rows(self._model, layer)  # [F, H]
        activated = gated_activation(F.linear(x, w_gate), self._activation)  # [S, F]
        chosen = select_features(activated, min(self.k, n))  # [S, k]
        if x.shape[0] == 1:  # decode: whole-row gathers and two small mat-vecs
            idx = chosen[0]
            coefficient = activated[0, idx] * (w_up.index_select(0, idx) @ x[0])  # [k]
            return (coefficient @ w_down.index_select(0, idx)).unsqueeze(0)  # [1, H]
        out = torch.empty_like(x)  # [S, H]
        step = max(1, _GATHER_ELEMENTS // (self.k * x.shape[1]))
        for start in range(0, x.shape[0], step):
            rows = slice(start, start + step)
            idx = chosen[rows]  # [s, k]
            up = torch.bmm(w_up[idx], x[rows].unsqueeze(-1)).squeeze(-1)  # [s, k]
            coefficient = activated[rows].gather(1, idx) * up  # [s, k]
            out[rows] = torch.bmm(coefficient.unsqueeze(1), w_down[idx]).squeeze(1)
        return out


# ---------------------------------------------------------------------------- feature view
