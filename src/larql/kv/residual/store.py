"""The residual store the residual-stream engines keep, every layer's rows side by side.

Canonical state, per layer: the pre-layer residual (the hidden entering the layer, before its
input norm) of every position — the last `window` rows in a hot tier (model dtype), the older
rows in a cold tier behind a `ColdCodec`. Derivative state, per layer: the K/V of every position,
cold then hot, contiguous from absolute position 0 in a `KvBuffer`, extended in O(1) per step by
the attention block itself. It can be dropped at any time and rebuilt from the residuals with
`recompute_kv` — that is what makes the residuals a sufficient state.

The tiers hold a position's rows of every layer together, [positions, layers, H]: a step
stores, evicts and codes all its layers' rows in one operation each, not one per layer. Layers
with one codec share a cold tier (a policy may give layers different codecs); a layer that
attends over another layer's K/V (`keeps_kv` False: Gemma 4's K/V-sharing layers) holds
nothing: no residuals, no K/V.

Position invariant: cold rows are positions [0, cold_len), hot rows
are [next_position − hot_len, next_position), cold_len + hot_len = next_position, and row p of the
K/V buffer is position p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from larql.inference.errors import InvariantViolation
from larql.inference.layer import recompute_kv
from larql.inference.memory import MemoryBreakdown
from larql.inference.snapshots import StateReader, StateWriter
from larql.kv.buffers import KvBuffer
from larql.kv.residual.codecs import ColdCodec, new_codec
from larql.kv.rows import GrowableRows
from larql.models.model import Model


@dataclass(frozen=True)
class EvictedRows:
    """Rows that just moved from the hot to the cold tier, on the layers whose codec is lossy
    for them (their K/V, computed from the rows as they were, no longer match what is kept)."""

    first_position: int  # absolute position of the first evicted row
    layers: list[int]  # the lossy layers, tier by tier
    stored: torch.Tensor  # [n, len(layers), H]: their rows as the cold tier gives them back


class ColdTier:
    """The cold rows of the layers that share one codec: [cold_len, len(layers), H]."""

    def __init__(self, label: str, layers: list[int], columns: list[int]) -> None:
        self.label = label
        self.layers = layers  # model layers, ascending
        self.columns = columns  # their columns in the store's rows
        self.codec: ColdCodec = new_codec(label)


class ResidualStore:
    """Hot/cold pre-layer residuals and derivative K/V of every layer."""

    def __init__(
        self,
        window: int | None,
        codec_labels: Sequence[str],
        keeps_kv: Sequence[bool] | None = None,
    ) -> None:
        self.window = window
        self.keeps_kv = list(keeps_kv) if keeps_kv is not None else [True] * len(codec_labels)
        self.layers = [layer for layer, keeps in enumerate(self.keeps_kv) if keeps]
        # each layer's column in the stored rows (None: the layer holds nothing)
        self.columns: list[int | None] = [None] * len(self.keeps_kv)
        for column, layer in enumerate(self.layers):
            self.columns[layer] = column
        if not self.layers:
            raise InvariantViolation("a residual store needs a layer that keeps its K/V")
        self.hot = GrowableRows()  # [hot_len, layers kept, H]
        self.cold: list[ColdTier] = []
        for label in dict.fromkeys(codec_labels[layer] for layer in self.layers):
            layers = [layer for layer in self.layers if codec_labels[layer] == label]
            self.cold.append(ColdTier(label, layers, [self.layers.index(x) for x in layers]))
        self.kv: list[KvBuffer] | None = [KvBuffer() for _ in codec_labels]
        self.next_position = 0
        self._pushed = 0  # rows pushed and not yet advanced (0: none)

    @property
    def num_layers(self) -> int:
        return len(self.keeps_kv)

    @property
    def hot_len(self) -> int:
        return len(self.hot)

    @property
    def cold_len(self) -> int:
        return len(self.cold[0].codec)

    def hot_positions(self) -> range:
        return range(self.next_position - self.hot_len, self.next_position)

    def cold_positions(self) -> range:
        return range(0, self.cold_len)

    def hot_rows(self, layer: int) -> torch.Tensor:
        """One layer's hot rows, [hot_len, H] (a view, valid until the next push)."""
        column = self.columns[layer]
        if column is None or not self.hot_len:
            raise IndexError(f"layer {layer} holds no hot rows")
        return self.hot.rows[:, column]

    def cold_rows(self, layer: int) -> torch.Tensor:
        """One layer's cold rows as its codec gives them back, [cold_len, H]."""
        for tier in self.cold:
            if layer in tier.layers:
                return tier.codec.decode(tier.layers.index(layer))
        raise IndexError(f"layer {layer} holds no cold rows")

    def expect(self, tokens: int) -> None:
        """Up to `tokens` positions are coming: their derivative K/V allocated at once, and
        the hot tier too where it keeps every position (no window)."""
        if self.window is None:
            self.hot.expect(tokens)
        for buffer in self.kv or []:
            buffer.expect(tokens)

    def push(self, layer: int, h: torch.Tensor) -> None:
        """Record one layer's pre-layer residual rows h: [S, H] of the positions being
        computed; every layer that keeps rows takes the same S before `advance`."""
        column = self.columns[layer]
        if column is None:
            return
        rows = self._pushing(h.shape[0], h)
        rows[:, column] = h

    def push_layers(self, h: torch.Tensor) -> None:
        """Every layer's pre-layer residual rows at once: h [L, S, H] (all the model's layers,
        those that hold nothing included)."""
        kept = h if len(self.layers) == h.shape[0] else h[self.layers]
        self._pushing(h.shape[1], h[0]).copy_(kept.transpose(0, 1))

    def _pushing(self, s: int, like: torch.Tensor) -> torch.Tensor:
        """The S rows the positions being computed fill, [S, layers kept, H]."""
        if self._pushed and s != self._pushed:
            raise InvariantViolation(f"layers pushed {self._pushed} and {s} rows in one pass")
        self._pushed = s
        reserved = self.hot.reserve_back(s)  # None before the first rows
        if reserved is None:
            shape = (s, len(self.layers), like.shape[-1])
            reserved = self.hot.reserve_back(s, like.new_empty(shape))
        assert reserved is not None
        data, _, end = reserved
        return data[end : end + s]

    def advance(self, rows: int) -> None:
        """The rows pushed to every layer are done: they now occupy the next positions."""
        if self._pushed != rows:
            raise InvariantViolation(f"{self._pushed} rows were pushed, {rows} advanced")
        self.hot.commit(rows)
        self._pushed = 0
        self.next_position += rows

    def evict_overflow(self, most: int | None = None) -> EvictedRows | None:
        """Move the hot rows beyond `window` (the oldest; at most `most` of them) into the cold
        tiers → the evicted rows of the layers whose codec is lossy for them (None: no
        eviction, or none lossy)."""
        overflow = 0 if self.window is None else self.hot_len - self.window
        if most is not None:
            overflow = min(overflow, most)
        if overflow <= 0:
            return None
        first = self.cold_len  # before appending: the true position of the first row
        rows = self.hot.pop_front(overflow)  # [n, layers kept, H]
        lossy: list[tuple[list[int], torch.Tensor]] = []
        for tier in self.cold:
            whole = len(tier.columns) == len(self.layers)
            stored = tier.codec.append(rows if whole else rows[:, tier.columns])
            if not tier.codec.lossless_for(rows.dtype):
                lossy.append((tier.layers, stored))
        if not lossy:
            return None
        layers = [layer for tier_layers, _ in lossy for layer in tier_layers]
        parts = [stored for _, stored in lossy]
        return EvictedRows(first, layers, parts[0] if len(parts) == 1 else torch.cat(parts, 1))

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
            buffer.append(*recompute_kv(model, layer, self.cold_rows(layer).contiguous(), 0))
        return buffer

    def rebuild_hot_kv(self, model: Model, layer: int, buffer: KvBuffer) -> None:
        """Extend `buffer` (holding the cold K/V) with the hot rows' K/V at their positions."""
        if self.hot_len and self.keeps_kv[layer]:
            hot = self.hot_rows(layer).contiguous()  # [hot_len, H]
            buffer.append(*recompute_kv(model, layer, hot, self.next_position - self.hot_len))

    def replace_kv(self, model: Model, evicted: EvictedRows) -> None:
        """Give lossily stored rows the K/V of their stored rows, at their true positions."""
        assert self.kv is not None
        for column, layer in enumerate(evicted.layers):
            rows = evicted.stored[:, column].contiguous()  # [n, H]
            k, v = recompute_kv(model, layer, rows, evicted.first_position)
            self.kv[layer].replace_row(evicted.first_position, k, v)

    # ------------------------------------------------------------------ saved state

    def write_state(self, state: StateWriter, positions: int | None = None) -> None:
        """`hot` [hot_len, layers kept, H]; each cold tier's rows (`cold.N.rows`); whether the
        derivative K/V is kept (`derivative`) and, if so, each layer's (`kv.N.k`, `.v`).
        With `positions`, the rows of the first that many positions only: those cold stay
        cold as they are stored, the K/V rows past them are left out."""
        if positions is None or positions == self.next_position:
            hot, cold, kv_rows = self.hot.live_rows(), None, None
        else:
            if not 0 <= positions < self.next_position:
                raise InvariantViolation(f"{positions} of {self.next_position} positions asked")
            cold = min(positions, self.cold_len)
            held = self.hot.live_rows()
            hot = None if held is None else held[: positions - cold]
            kv_rows = positions
        state.tensor("hot", hot)
        for index, tier in enumerate(self.cold):
            tier.codec.write_state(state.scope(f"cold.{index}"), cold)
        state.put("derivative", self.kv is not None)
        for layer, buffer in enumerate(self.kv or []):
            buffer.write_state(state.scope(f"kv.{layer}"), kv_rows)

    def read_state(self, state: StateReader, model: Model, position: int) -> None:
        """Take back the rows of `position` positions into this empty store: at most the last
        `window` hot (fewer where the state is a longer one's prefix, whose rows cold then
        stay so), the rest cold, the K/V of every position where it was kept."""
        cfg, dtype = model.config, model.dtype
        hot_len = position
        if self.window is not None:
            hot_len = state.row_count("hot", 0, min(position, self.window))
        width = (len(self.layers), cfg.hidden_size)
        self.hot = GrowableRows.holding(state.rows("hot", dtype, hot_len, width))
        for index, tier in enumerate(self.cold):
            shape = (len(tier.layers), cfg.hidden_size)
            tier.codec.read_state(state.scope(f"cold.{index}"), position - hot_len, shape, dtype)
        if state.flag("derivative"):
            assert self.kv is not None
            for layer, buffer in enumerate(self.kv):
                held = position if self.keeps_kv[layer] else 0
                buffer.read_state(
                    state.scope(f"kv.{layer}"),
                    held,
                    dtype,
                    cfg.kv_heads_of(layer),
                    cfg.head_dim_of(layer),
                )
        else:
            self.kv = None
        self.next_position, self._pushed = position, 0

    # ------------------------------------------------------------------ accounting

    def memory(self) -> MemoryBreakdown:
        cold = [tier.codec for tier in self.cold]
        return MemoryBreakdown.of(hot=[self.hot], cold=cold, derivative=self.kv or [])
