"""The per-layer residual store the residual-stream engines keep.

Canonical state, per layer: the pre-layer residual (the hidden entering the layer, before its
input norm) of every position — the last `window` rows in a hot tier (model dtype), the older
rows in a cold tier behind a `ColdCodec`. Derivative state, per layer: the K/V of every position,
cold then hot, contiguous from absolute position 0 in a `KvBuffer`, extended in O(1) per step by
the attention block itself. It can be dropped at any time and rebuilt from the residuals with
`recompute_kv` — that is what makes the residuals a sufficient state.

Position invariant: cold rows are positions [0, cold_len), hot rows
are [next_position − hot_len, next_position), cold_len + hot_len = next_position, and row p of the
K/V buffer is position p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from larql.inference.layer import recompute_kv
from larql.inference.memory import MemoryBreakdown
from larql.kv.buffers import KvBuffer
from larql.kv.residual.codecs import ColdCodec, new_codec
from larql.kv.rows import GrowableRows
from larql.models.model import Model


@dataclass(frozen=True)
class EvictedBlock:
    """Rows of one layer that just moved from the hot to the cold tier."""

    layer: int
    first_position: int  # absolute position of the first evicted row
    stored: torch.Tensor  # [n, H] the rows as the cold tier gives them back
    lossless: bool  # stored == the rows that left the hot tier


class ResidualStore:
    """Hot/cold pre-layer residuals and derivative K/V of every layer. A layer that attends over
    another layer's K/V (`keeps_kv` False: Gemma 4's K/V-sharing layers) holds nothing: no
    residuals, no K/V."""

    def __init__(
        self,
        window: int | None,
        codec_labels: Sequence[str],
        keeps_kv: Sequence[bool] | None = None,
    ) -> None:
        self.window = window
        self.keeps_kv = list(keeps_kv) if keeps_kv is not None else [True] * len(codec_labels)
        self.hot = [GrowableRows() for _ in codec_labels]  # [hot_len, H] each
        self.cold: list[ColdCodec] = [new_codec(label) for label in codec_labels]
        self.kv: list[KvBuffer] | None = [KvBuffer() for _ in codec_labels]
        self.next_position = 0

    @property
    def num_layers(self) -> int:
        return len(self.hot)

    @property
    def hot_len(self) -> int:
        return len(self.hot[0])

    @property
    def cold_len(self) -> int:
        return len(self.cold[0])

    def hot_positions(self) -> range:
        return range(self.next_position - self.hot_len, self.next_position)

    def cold_positions(self) -> range:
        return range(0, self.cold_len)

    def push(self, layer: int, h: torch.Tensor) -> None:
        """Record the pre-layer residual rows h: [S, H] of the positions being computed."""
        if self.keeps_kv[layer]:
            self.hot[layer].append(h)

    def advance(self, rows: int) -> None:
        """The rows pushed to every layer are done: they now occupy the next positions."""
        self.next_position += rows

    def evict_overflow(self) -> list[EvictedBlock]:
        """Move each layer's hot rows beyond `window` (the oldest) into its cold tier."""
        overflow = 0 if self.window is None else self.hot_len - self.window
        if overflow <= 0:
            return []
        first = self.cold_len  # snapshot before appending: the true position of the first row
        blocks = []
        for layer, (hot, cold) in enumerate(zip(self.hot, self.cold, strict=True)):
            if not self.keeps_kv[layer]:
                continue
            rows = hot.pop_front(overflow)  # [overflow, H]
            stored = cold.append(rows)
            blocks.append(EvictedBlock(layer, first, stored, cold.lossless_for(rows.dtype)))
        return blocks

    # ------------------------------------------------------------------ derivative K/V

    @property
    def has_derivative(self) -> bool:
        return self.kv is not None

    def drop_derivative(self) -> None:
        """Forget every cached K/V; the next step rebuilds them from the residuals."""
        self.kv = None

    def rebuild_cold_kv(self, model: Model, layer: int) -> KvBuffer:
        """A fresh K/V buffer of one layer holding the cold rows' K/V at positions 0.."""
        buffer = KvBuffer()
        if self.cold_len and self.keeps_kv[layer]:
            buffer.append(*recompute_kv(model, layer, self.cold[layer].decode(), 0))
        return buffer

    def rebuild_hot_kv(self, model: Model, layer: int, buffer: KvBuffer) -> None:
        """Extend `buffer` (holding the cold K/V) with the hot rows' K/V at their positions."""
        if self.hot_len and self.keeps_kv[layer]:
            hot = self.hot[layer].rows  # [hot_len, H]
            buffer.append(*recompute_kv(model, layer, hot, self.next_position - self.hot_len))

    def replace_kv(self, model: Model, block: EvictedBlock) -> None:
        """Give a lossily stored block the K/V of its stored rows, at their true positions."""
        assert self.kv is not None
        k, v = recompute_kv(model, block.layer, block.stored, block.first_position)
        self.kv[block.layer].replace_row(block.first_position, k, v)

    # ------------------------------------------------------------------ accounting

    def memory(self) -> MemoryBreakdown:
        return MemoryBreakdown.of(hot=self.hot, cold=self.cold, derivative=self.kv or [])
