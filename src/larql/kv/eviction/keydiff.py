"""`keydiff`: keep the keys least like the rest. Per layer and K/V head, a row's score is
1 − cos(k_i, k̄), k̄ the mean direction of the prompt's unit keys: rows whose key points where
most keys point add little a query could not find in their neighbours, and the distinctive ones
are what a later question may single out. Reads no query — query-agnostic whatever the prompt
holds — and costs one pass over the keys."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from larql.kv.eviction.scoring import ScoringEngine
from larql.models.model import Model


class KeyDiffEngine(ScoringEngine):
    name = "keydiff"

    def scorer(self) -> str:
        return "the rows whose keys differ most from the mean key direction"

    def _row_scores(
        self, model: Model, layer: int, held: object, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        unit = F.normalize(k.float(), dim=-1)  # [Hkv, T, D]
        anchor = F.normalize(unit.mean(dim=1, keepdim=True), dim=-1)  # [Hkv, 1, D]
        return 1.0 - (unit * anchor).sum(dim=-1)  # [Hkv, T], in [0, 2]
