"""`h2o` (Heavy-Hitter Oracle): each layer and K/V head keeps at most `budget` rows — the
`recent` newest, and of the older ones those with the most attention accumulated so far (every
query's softmax weight on the row, summed over the query heads sharing the K/V head). The
prefill attends exactly, then cuts each layer to the budget; every decode step adds its
query's weights and, past the budget, evicts the lightest older row."""

from __future__ import annotations

import torch

from larql.kv.eviction.budget import Budget
from larql.kv.eviction.scores import attention_mass
from larql.kv.eviction.scoring import ScoringEngine
from larql.models.model import Model


class H2oEngine(ScoringEngine):
    name = "h2o"
    evicts_in_decode = True
    compresses_once = False
    STATE_VERSION = 2  # rows first, `score` for `mass`; packed per head with heads=adaptive

    def __init__(
        self,
        budget: int = 512,
        recent: int = 256,
        profiling: bool = False,
        keep: float | None = None,
        sinks: int = 0,
        heads: str = "uniform",
        layers: str = "uniform",
    ) -> None:
        if not 0 <= recent < budget:
            raise ValueError(f"h2o needs 0 ≤ recent < budget, got budget={budget}, recent={recent}")
        rows = None if keep is not None else budget
        super().__init__(Budget(keep, rows, sinks, recent, heads, layers), profiling)  # type: ignore[arg-type]

    def scorer(self) -> str:
        return "the heaviest rows by attention accumulated over every query so far"

    def _observe(
        self,
        model: Model,
        layer: int,
        held: object,
        q: torch.Tensor,
        start: int,
        keys: torch.Tensor,
    ) -> torch.Tensor:
        """The attention the prompt's queries so far put on each row [Hkv, start + n]."""
        mass = attention_mass(model, q, keys, start)  # this part's queries
        if held is not None:
            assert isinstance(held, torch.Tensor)
            mass[:, : held.shape[1]] += held
        return mass

    def _row_scores(
        self, model: Model, layer: int, held: object, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        assert isinstance(held, torch.Tensor)
        return held

    def _rescored(self, score: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return score + weights
