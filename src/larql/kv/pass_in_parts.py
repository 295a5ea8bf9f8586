"""A forward pass over a prompt from position 0, some positions at a time: each part's rows attend
over the exact K/V of every earlier part, kept here until the pass ends. Engines whose state is
not a K/V cache (`no-cache`), or whose prefill codes or evicts the prompt's K/V once it is whole
(`turbo-quant`, `kv-quant`, `snapkv`, `h2o`), take a long prompt in parts through it, with the
rows and K/V of one whole pass up to the order of float sums."""

from __future__ import annotations

from collections.abc import Callable

import torch

from larql.inference.ffn import FfnBackend
from larql.inference.layer import (
    attention_block,
    embed_rows,
    ffn_block,
    layer_step,
)
from larql.inference.shared_kv import SharedKv
from larql.kv.buffers import KvBuffer
from larql.models.model import Model

# (layer, the part's queries q [Hq, n, D] as the layer attended with them, start, its K/V)
Observer = Callable[[int, torch.Tensor, int, KvBuffer], None]


class PassInParts:
    def __init__(self, model: Model) -> None:
        self.layers = [KvBuffer() for _ in range(model.config.num_layers)]  # exact K/V
        self.length = 0  # positions done

    def run(
        self, model: Model, ffn: FfnBackend, ids: torch.Tensor, observe: Observer | None = None
    ) -> torch.Tensor:
        """The next positions' token ids [n] → their pre-final-norm hidden rows [n, H].
        `observe(layer, q, start, kv)` sees each layer's queries q [Hq, n, D] (at positions
        start..) once the layer's K/V `kv` holds the part's rows too."""
        h, inputs = embed_rows(model, ids.long())  # [n, H], [n, L, P] or None
        start = self.length
        shared = SharedKv(model.config)  # a K/V-sharing layer's buffer stays empty
        for layer, kv in enumerate(self.layers):
            if observe is None:
                h = layer_step(model, layer, h, start, kv, ffn, inputs=inputs, shared=shared)
                continue
            queries: list[torch.Tensor] = []
            h = attention_block(model, layer, h, start, kv, shared=shared, queries=queries)
            h = ffn_block(model, layer, h, ffn, inputs)
            observe(layer, queries[0], start, kv)
        self.length += ids.shape[0]
        return h

    def copy(self) -> PassInParts:
        """An independent pass at the same point: its exact K/V copied."""
        out = PassInParts.__new__(PassInParts)
        out.layers = [layer.copy() for layer in self.layers]
        out.length = self.length
        return out

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
