"""An eviction composed with a quantiser, decoding on the quantiser's Triton kernels (CUDA).

Once the prompt is in, each layer's kept rows go into a `KernelPath` as the quantiser alone would
hold a prompt of that many rows: row i of every K/V head its i-th kept row (keys carry their
rotary position already, so only the count and the order matter), each decoded row after them.
The tokens keep their own positions for RoPE; a layer's stores are laid out by its row count,
the position less the prompt's rows it did not keep (`KernelPath.start`'s `rows`). A sliding
layer keeps its window by position, as the quantiser alone does. Decode is then the quantiser's
own step: its launches over the codes in place, the whole step in a CUDA graph, and the memory
held is that of the kept rows' codes.

Between the policy's choice and the prompt's last layer, a layer's rows wait as they are
(`ExactKept`); then every layer's go into the path together (its slots are sized by the most
rows a layer keeps). Where the path does not take them — a policy keeping another count of rows
on each head (`heads=adaptive`, kvzip's `layers=adaptive`) or rescoring rows as it decodes
(`h2o`, `tova`), or a model or codec the kernels do not take — they are coded into the torch
path's stores instead, as on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from larql.inference.memory import tensor_bytes
from larql.kv.turbo_quant.engine import TurboQuantEngine, on_kernel_path
from larql.kv.turbo_quant.kernel_path import KernelPath
from larql.kv.turbo_quant.store import QuantisedLayer
from larql.models.model import Model


class ExactKept:
    """A layer's rows as they are until the prompt's every layer is kept: a full-attention
    layer's kept rows, or a sliding layer's prompt rows (`window`: the rows it keeps)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, window: int | None = None):
        self.keys, self.values = keys, values  # [Hkv, n, D] each
        self.window = window

    def __len__(self) -> int:
        return self.keys.shape[1]

    def nbytes(self) -> int:
        return tensor_bytes(self.keys, self.values)


def kernels_take(quantiser: TurboQuantEngine, model: Model) -> bool:
    """Whether the quantiser's kernel path runs on `model` (its layouts prepared on the way)."""
    keeps = quantiser._prepare_layouts(model)
    return quantiser.kernels_taking(model, keeps) is not None


def settle(
    quantiser: TurboQuantEngine,
    model: Model,
    layers: list,
    prompt_length: int,
    coded: Callable[[int, ExactKept], object],
) -> KernelPath | None:
    """A prompt's layers once each is kept (`ExactKept` where it waits) → the kernel path holding
    them, or None: the layers that waited are then coded in place through `coded(layer, rows)`
    (the torch path's stores). Layers sharing another's K/V hold nothing and stay as they are."""
    waiting = [i for i, held in enumerate(layers) if isinstance(held, ExactKept)]
    if not waiting:
        return None
    holding = [i for i, held in enumerate(layers) if len(held) or isinstance(held, ExactKept)]
    path = None
    if waiting == holding:
        keeps = quantiser._prepare_layouts(model)
        path = quantiser._kernel_path(model, keeps)
    if path is None:
        for i in waiting:
            layers[i] = coded(i, layers[i])
        return None
    rows = [len(held) if isinstance(held, ExactKept) else 0 for held in layers]
    # a sliding layer keeps its window by position: it holds every token (offset 0)
    rows = [
        prompt_length if isinstance(held, ExactKept) and held.window is not None else n
        for held, n in zip(layers, rows, strict=True)
    ]
    path.start(model, prompt_length, rows)
    for i in waiting:
        held = layers[i]
        path.store_prompt(i, held.keys, held.values)
        layers[i] = None  # the rows live in the path now
    return path


def resettle(
    quantiser: TurboQuantEngine, model: Model, layers: list, position: int
) -> KernelPath | None:
    """Every layer's store read back from a saved state at `position` tokens (a full-attention
    layer's kept rows, a sliding layer's window) → the kernel path holding them as `settle`
    would (the entries then None), or None where a layer is held otherwise (each head its own
    count) or a store is not laid out as the path lays out its rows."""
    if not layers or not all(isinstance(held, QuantisedLayer) for held in layers):
        return None
    keeps = quantiser._prepare_layouts(model)
    # a sliding layer keeps its window by position: it holds every token (offset 0)
    rows = [len(held) if held.codes.keep is None else position for held in layers]
    path = on_kernel_path(quantiser._kernel_path(model, keeps), model, position, layers, rows)
    if path is not None:
        layers[:] = [None] * len(layers)
    return path
