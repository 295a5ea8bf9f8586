"""`tova` (Token Omission Via Attention): a row is worth what the newest query attends to it.
At the end of the prompt each layer keeps, per K/V head, the rows the prompt's last query
attends to most (its weights averaged over the query heads sharing the K/V head); each decode
step then rescores every kept row by the step's own query — the current attention, not an
accumulated one as `h2o`'s — and drops the lowest past the budget.

Query-aware when the prompt ends with the question (its last token's query chooses)."""

from __future__ import annotations

import torch

from larql.kv.eviction.budget import Budget
from larql.kv.eviction.scores import attention_mass
from larql.kv.eviction.scoring import ScoringEngine
from larql.models.model import Model


class TovaEngine(ScoringEngine):
    name = "tova"
    evicts_in_decode = True
    compresses_once = False

    def __init__(self, budget: Budget, profiling: bool = False) -> None:
        super().__init__(budget, profiling)

    def scorer(self) -> str:
        return "the rows the newest query attends to most, rescored at every step"

    def _observe(
        self,
        model: Model,
        layer: int,
        held: object,
        q: torch.Tensor,
        start: int,
        keys: torch.Tensor,
    ) -> torch.Tensor:
        """The last query so far [Hq, 1, D]."""
        return q[:, -1:]

    def _row_scores(
        self, model: Model, layer: int, held: object, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        assert isinstance(held, torch.Tensor)
        group = held.shape[0] // k.shape[0]
        return attention_mass(model, held, k, k.shape[1] - 1) / group  # [Hkv, T]

    def _rescored(self, score: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return weights
