"""How many prompt rows a scoring engine keeps and which: the selection every scorer shares.

A scorer gives each prompt row a score per K/V head ([Hkv, T], ≥ 0, higher = keep). The budget
is `keep` (a fraction of the prompt rows) or `rows` (rows per K/V head), sinks and recent
counted in; the first `sinks` rows and the last `recent` are always kept. `heads`:

- `uniform`: every K/V head keeps the same count, its own best-scored rows;
- `adaptive` (AdaKV-style): one budget for all the heads of a layer. Each head's scores are
  normalised to sum to 1 over the rows it may drop, and the layer's best rows are picked across
  heads, so a head whose attention is concentrated keeps fewer rows and a diffuse one more.
  The protected rows (sinks, recent) give every head a floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

HeadsMode = Literal["uniform", "adaptive"]
HEADS_MODES = ("uniform", "adaptive")


@dataclass(frozen=True)
class Budget:
    """keep: a fraction (0, 1] of the prompt rows, or None; rows: rows per K/V head, or None
    (one of the two is set); sinks, recent: rows always kept at each end of the prompt."""

    keep: float | None = None
    rows: int | None = None
    sinks: int = 0
    recent: int = 0
    heads: HeadsMode = "uniform"

    def __post_init__(self) -> None:
        if (self.keep is None) == (self.rows is None):
            raise ValueError("a budget is a keep fraction or a row count, exactly one")
        if self.keep is not None and not 0 < self.keep <= 1:
            raise ValueError(f"keep must be in (0, 1], got {self.keep}")
        if self.rows is not None and self.rows < 1:
            raise ValueError(f"rows must be ≥ 1, got {self.rows}")
        if self.sinks < 0 or self.recent < 0 or self.heads not in HEADS_MODES:
            raise ValueError(f"bad budget {self}")

    def per_head(self, prompt: int) -> int:
        """Rows each K/V head keeps of a `prompt`-row prompt (adaptive: on average): at least
        sinks + recent, at most all of them."""
        wanted = self.rows or 0
        if self.keep is not None:
            wanted = math.ceil(self.keep * prompt - 1e-9)
        return min(prompt, max(wanted, self.sinks + self.recent, 1))

    def describe(self) -> str:
        size = f"{self.keep:g} of the prompt rows" if self.keep else f"{self.rows} rows"
        return (
            f"{size} per layer ({self.heads} over its K/V heads), the first {self.sinks} and the "
            f"last {self.recent} always"
        )

    def config(self) -> str:
        size = f"keep={self.keep:g}" if self.keep is not None else f"budget={self.rows}"
        return f"{size},sinks={self.sinks},recent={self.recent},heads={self.heads}"

    def protected(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [Hkv, T] → the same with the sinks and recent rows at +inf."""
        t = scores.shape[-1]
        position = torch.arange(t, device=scores.device)
        always = (position < self.sinks) | (position >= t - self.recent)  # [T]
        return scores.masked_fill(always, float("inf"))

    def uniform(self, scores: torch.Tensor, count: int) -> torch.Tensor:
        """scores [Hkv, T] → the `count` rows each head keeps, in position order [Hkv, count]."""
        chosen = self.protected(scores.float()).topk(count, dim=-1).indices
        return chosen.sort(dim=-1).values

    def adaptive(self, scores: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """scores [Hkv, T] → the Hkv·count rows the layer keeps, picked across heads after
        normalising each head's droppable scores to sum 1: (their head [N], their position
        [N]), head-major and in position order within a head (N = Hkv·count)."""
        heads, t = scores.shape
        marked = self.protected(scores.float())
        droppable = torch.where(torch.isinf(marked), torch.zeros_like(marked), marked)
        share = droppable / droppable.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        share = torch.where(torch.isinf(marked), marked, share)  # [Hkv, T]
        flat = share.reshape(-1).topk(heads * count).indices.sort().values  # [N]
        return flat // t, flat % t

    def adaptive_packed(
        self, score: torch.Tensor, head: torch.Tensor, offsets: torch.Tensor, total: int
    ) -> torch.Tensor:
        """`adaptive` over rows packed head-major (`RaggedRows`): score [N], head [N] each
        row's head, offsets [Hkv + 1] → the `total` rows kept, in order [total]; each head's
        first sinks and last recent rows always."""
        rank = torch.arange(score.shape[0], device=score.device) - offsets[head]  # [N]
        count = offsets.diff()[head]
        always = (rank < self.sinks) | (rank >= count - self.recent)
        droppable = torch.where(always, torch.zeros_like(score), score.float())
        sums = droppable.new_zeros(offsets.shape[0] - 1).index_add_(0, head, droppable)
        share = droppable / sums[head].clamp_min(1e-30)
        share = share.masked_fill(always, float("inf"))
        return share.topk(total).indices.sort().values
