"""What `larql walk` looks at inside an FFN: the features firing at a position, the tokens a
feature's down column writes, and a recorder of each layer's FFN input."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from larql.inference.ffn.activation import gated_activation
from larql.inference.ffn.backend import FfnBackend
from larql.inference.ffn.walk import select_features
from larql.models.model import Model


@dataclass(frozen=True)
class FiringFeature:
    feature: int
    activation: float  # act(gate·x) · (up·x): the coefficient of the feature's down column
    gate: float  # act(gate·x), what the walk ranks by


def firing_features(
    model: Model, layer: int, x: torch.Tensor, k: int | None, top: int
) -> list[FiringFeature]:
    """x: [H] pre-FFN-normed residual of one position → the `top` features with the largest
    |activation| among those a walk with this k keeps (all features when k is None)."""
    lw = model.weights.layers[layer]
    gate, up = F.linear(x.unsqueeze(0), lw.w_gate_up).chunk(2, dim=-1)  # [1, F] each
    activated = gated_activation(gate, model.config.arch.activation)
    n = activated.shape[-1]
    kept = (
        select_features(activated, min(k, n))[0]
        if k is not None
        else torch.arange(n, device=x.device)
    )
    coefficient = (activated * up)[0, kept]  # [k]
    order = coefficient.abs().argsort(descending=True)[:top]
    return [
        FiringFeature(int(kept[i]), float(coefficient[i]), float(activated[0, kept[i]]))
        for i in order
    ]


def down_tokens(model: Model, layer: int, feature: int, n: int) -> list[int]:
    """The n token ids the feature's down column writes most strongly through the unembedding
    (top of lm_head · down_f; a negative activation pushes these tokens down instead)."""
    column = model.weights.layers[layer].w_down[:, feature]  # [H]
    return F.linear(column, model.weights.lm_head).topk(n).indices.tolist()


class LastRowRecorder(FfnBackend):
    """Wraps an FFN and keeps each layer's pre-FFN-normed input at the last position, so a
    caller can ask which features fired there."""

    def __init__(self, inner: FfnBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.kinds = inner.kinds  # type: ignore[method-assign]
        self.inputs: dict[int, torch.Tensor] = {}

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        self.inputs[layer] = x[-1].detach().clone()  # [H]
        return self.inner.forward(layer, x)
