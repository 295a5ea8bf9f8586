"""`ScoringEngine`: the eviction engines that differ only in how they score the prompt's rows.

A scorer declares what it reads of the prompt's queries as they come (`_observe`: nothing by
default) and a score per prompt row and K/V head (`_row_scores` → [Hkv, T] float32, ≥ 0,
higher = keep). The selection is shared (`Budget`): keep= or budget=, sinks and a recent window
always kept, `heads=uniform` (each K/V head keeps the same count: a `KvBuffer` of the kept rows)
or `heads=adaptive` (one budget over the layer's heads, picked across them: `RaggedRows`, each
head its own count, the bytes of the rows kept and no more). A layer whose K/V a later layer
reads (Gemma 4's shared K/V) stays uniform: the sharing layer attends over the same tensors.

A scorer whose policy goes on evicting as it decodes (`evicts_in_decode`: `h2o`, `tova`) keeps a
score per row (`ScoredRows`, or `RaggedRows` with scores) and holds each layer to its budget of
the positions seen so far (`keep` of them, or `budget` rows) — so `keep=1` never evicts; every
step rescores the rows by the step's attention (`_rescored`) and drops the lowest past the
budget (adaptive: across heads, as the prompt's selection). The others keep every decoded row.
Composed with a quantiser, the rows are the storage's (`larql.kv.composed`): scored by the
weights its decode attention put on the rows it holds, dropped by its `keep`.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch

from larql.inference.shared_kv import SharedKv
from larql.inference.snapshots import SnapshotCorrupt, StateReader
from larql.kv.buffers import KvBuffer
from larql.kv.eviction.base import EvictingEngine
from larql.kv.eviction.budget import Budget
from larql.kv.eviction.ragged import RaggedRows
from larql.kv.eviction.scored import ScoredRows
from larql.kv.eviction.scores import attention_mass, gather_rows
from larql.models.model import Model


class ScoringEngine(EvictingEngine):
    evicts_in_decode = False
    compresses_once = True  # unless it evicts while decoding
    # every layer's scores are known before any layer is cut, and compare across layers (the
    # budget may then be one for the whole model: `layers=adaptive`)
    across_layers: ClassVar[bool] = False

    def __init__(self, budget: Budget, profiling: bool = False) -> None:
        if budget.layers == "adaptive" and not self.across_layers:
            raise ValueError(
                f"{self.name}: layers=adaptive picks rows across every layer at once, which "
                "needs every layer's scores before any is cut (kvzip); use layers=uniform or "
                "pyramid"
            )
        super().__init__(profiling)
        self.budget = budget

    # ------------------------------------------------------------------ the scorer

    @abstractmethod
    def scorer(self) -> str:
        """What the score of a row is, in a few words (`describe`)."""

    def scorer_config(self) -> str:
        """The scorer's own parameters, `key=value,…` ("" for none)."""
        return ""

    def _observe(
        self,
        model: Model,
        layer: int,
        held: object,
        q: torch.Tensor,
        start: int,
        keys: torch.Tensor,
    ) -> object:
        """Nothing is read of the queries unless a scorer says so."""
        return None

    @abstractmethod
    def _row_scores(
        self, model: Model, layer: int, held: object, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """The prompt's rows k, v [Hkv, T, D] and what `_observe` kept → scores [Hkv, T]."""

    def _rescored(self, score: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A decode step's attention weights on the rows → their new scores (evicts_in_decode)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the shared selection

    def describe(self) -> str:
        return f"{self.scorer()}; keeps {self.budget.describe()}"

    def config(self) -> str:
        return ",".join(c for c in (self.budget.config(), self.scorer_config()) if c)

    def _adaptive(self, model: Model, layer: int) -> bool:
        return self.budget.heads == "adaptive" and not SharedKv(model.config).is_source(layer)

    def _compressed(
        self, model: Model, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ):
        held = self._observe(model, layer, None, q, 0, k)
        return self._compressed_from(model, layer, held, k, v)

    def _compressed_from(
        self, model: Model, layer: int, held: object, k: torch.Tensor, v: torch.Tensor
    ):
        """The rows kept of the prompt's k, v [Hkv, T, D]: all where they fit the budget."""
        t = k.shape[1]
        count = self.budget.per_head(t, layer, model.config.num_layers)
        if count >= t and not self.evicts_in_decode:
            return _buffer(k, v)
        scores = self._row_scores(model, layer, held, k, v).float()  # [Hkv, T]
        if count >= t:
            return ScoredRows(k, v, scores)
        if self._adaptive(model, layer):
            head, position = self.budget.adaptive(scores, count)
            kept = scores if self.evicts_in_decode else None
            return RaggedRows.picked(k, v, head, position, kept)
        index = self.budget.uniform(scores, count)  # [Hkv, count]
        if self.evicts_in_decode:
            return ScoredRows(
                gather_rows(k, index), gather_rows(v, index), torch.gather(scores, 1, index)
            )
        return _buffer(gather_rows(k, index), gather_rows(v, index))

    def _attended(self, model: Model, layer: int, rows, q: torch.Tensor) -> None:
        """A policy evicting as it decodes rescores its rows by this step's query q [Hq, 1, D]
        and holds the layer to its budget of the positions seen."""
        if not self.evicts_in_decode:
            return
        count = self.budget.per_head(self.position + 1, layer, model.config.num_layers)
        if not isinstance(rows, ScoredRows | KvBuffer) and rows.score.dim() == 1:
            self._evict_ragged(rows, count)  # `RaggedRows`, or a storage's rows per head
            return
        if isinstance(rows, ScoredRows):
            weights = attention_mass(model, q, rows.keys, len(rows) - 1)  # [Hkv, n]
        else:  # a storage's rows (`KeptStorage`): the weights its step's attention put on them
            weights = rows.weights
        rows.score = self._rescored(rows.score, weights)
        if len(rows) <= count:
            return
        if isinstance(rows, ScoredRows) and self._adaptive(model, layer):
            head, position = self.budget.adaptive(rows.score, count)
            self._layers[layer] = RaggedRows.picked(
                rows.keys, rows.values, head, position, rows.score
            )
        else:
            rows.keep(self.budget.uniform(rows.score, count))

    def _evict_ragged(self, rows, count: int) -> None:
        """rows: a `RaggedRows`, or a storage's rows packed per head alike (`score` [N],
        `weights`, `merge`, `offsets`, `head_of_rows`, `keep`)."""
        packed, decoded = rows.weights  # this step's, from `RaggedRows.attend`
        assert rows.score is not None
        rows.score = self._rescored(rows.score, packed)
        rows.merge(self._rescored(torch.zeros_like(decoded), decoded))
        offsets = rows.offsets  # [Hkv + 1], the decoded rows merged
        total = (offsets.shape[0] - 1) * count
        if rows.score.shape[0] <= total:
            return
        head = rows.head_of_rows()  # [N]
        index = self.budget.adaptive_packed(rows.score, head, offsets, total)
        rows.keep(head[index], index)

    def _read_kept(self, state: StateReader, dtype: torch.dtype, heads: int, dim: int):
        """A layer's rows as written: packed per head (`offsets` present) or every head alike —
        with scores where the policy evicts as it decodes."""
        layout = state.row_count("offsets", 0, heads + 1)
        if layout == heads + 1:
            return RaggedRows.read_state(
                state, self.position, dtype, heads, dim, self.evicts_in_decode
            )
        if layout:
            raise SnapshotCorrupt(f"state tensor {state.prefix}offsets is not {heads + 1} long")
        if self.evicts_in_decode:
            return ScoredRows.read_state(state, self.position, dtype, heads, dim)
        count = state.row_count("k", min(1, self.position), self.position)
        buffer = KvBuffer()
        buffer.read_state(state, count, dtype, heads, dim)
        return buffer


def _buffer(k: torch.Tensor, v: torch.Tensor) -> KvBuffer:
    buffer = KvBuffer()
    buffer.append(k, v)
    return buffer
