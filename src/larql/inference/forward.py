"""A whole forward pass with no kept state: the oracle other paths are checked against, and what
the no-cache engine re-runs every step."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from larql.inference.ffn import FfnBackend
from larql.inference.layer import FreshKv, layer_step
from larql.inference.shared_kv import SharedKv
from larql.models.model import Model

# after_layer(layer, h) may return a replacement h (e.g. an injected perturbation).
LayerHook = Callable[[int, torch.Tensor], torch.Tensor | None]


def run_layers(
    model: Model,
    ffn: FfnBackend,
    h: torch.Tensor,
    start: int = 0,
    layers: Iterable[int] | None = None,
    window: int | None = None,
    after_layer: LayerHook | None = None,
    inputs: torch.Tensor | None = None,
) -> torch.Tensor:
    """h: [S, H] at positions start.. → pre-final-norm hidden [S, H] after `layers` (all by
    default), each attending causally within h only; `inputs`: the rows' per-layer inputs
    [S, L, P] (`layer.per_layer_inputs`, Gemma 4), None for models without."""
    shared = SharedKv(model.config)
    for layer in range(model.config.num_layers) if layers is None else layers:
        h = layer_step(model, layer, h, start, FreshKv(), ffn, window, inputs, shared)
        if after_layer is not None:
            replaced = after_layer(layer, h)
            if replaced is not None:
                h = replaced
    return h
