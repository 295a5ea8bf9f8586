"""How many prompt rows a scoring engine keeps and which: the selection every scorer shares.

A scorer gives each prompt row a score per K/V head ([Hkv, T], ≥ 0, higher = keep). The budget
is `keep` (a fraction of the prompt rows) or `rows` (rows per K/V head), sinks and recent
counted in; the first `sinks` rows and the last `recent` are always kept. `heads`:

- `uniform`: every K/V head keeps the same count, its own best-scored rows;
- `adaptive` (AdaKV-style): one budget for all the heads of a layer. Each head's scores are
  normalised to sum to 1 over the rows it may drop, and the layer's best rows are picked across
  heads, so a head whose attention is concentrated keeps fewer rows and a diffuse one more.
  The protected rows (sinks, recent) give every head a floor.

`layers` (PyramidKV-style): `uniform` gives every layer the same budget; `pyramid` gives the
lower layers more and the upper ones less on a straight line, layer 0 (1 + SPREAD)× the
budget and the last (1 − SPREAD)×, so the mean over the layers is the budget: the bytes are the
uniform schedule's, less where a lower layer's share is more than its whole prompt, more where
an upper layer's falls below the sinks and recent rows every layer keeps. Lower
layers attend broadly and upper ones to few rows, so the rows go where they are read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

HeadsMode = Literal["uniform", "adaptive"]
HEADS_MODES = ("uniform", "adaptive")
LayersMode = Literal["uniform", "pyramid", "adaptive"]
LAYERS_MODES = ("uniform", "pyramid", "adaptive")
SPREAD = 0.5  # pyramid: layer 0 keeps 1.5× the budget, the last layer 0.5×


@dataclass(frozen=True)
class Budget:
    """keep: a fraction (0, 1] of the prompt rows, or None; rows: rows per K/V head, or None
    (one of the two is set); sinks, recent: rows always kept at each end of the prompt."""

    keep: float | None = None
    rows: int | None = None
    sinks: int = 0
    recent: int = 0
    heads: HeadsMode = "uniform"
    layers: LayersMode = "uniform"

    def __post_init__(self) -> None:
        if (self.keep is None) == (self.rows is None):
            raise ValueError("a budget is a keep fraction or a row count, exactly one")
        if self.keep is not None and not 0 < self.keep <= 1:
            raise ValueError(f"keep must be in (0, 1], got {self.keep}")
        if self.rows is not None and self.rows < 1:
            raise ValueError(f"rows must be ≥ 1, got {self.rows}")
        if (
            self.sinks < 0
            or self.recent < 0
            or self.heads not in HEADS_MODES
            or self.layers not in LAYERS_MODES
        ):
            raise ValueError(f"bad budget {self}")

    def per_head(self, prompt: int, layer: int = 0, num_layers: int = 1) -> int:
        """Rows each K/V head of layer `layer` (of `num_layers`) keeps of a `prompt`-row
        prompt (adaptive: on average): at least sinks + recent, at most all of them."""
        wanted = float(self.rows or 0)
        if self.keep is not None:
            wanted = self.keep * prompt
        wanted *= self.layer_share(layer, num_layers)
        return min(prompt, max(math.ceil(wanted - 1e-9), self.sinks + self.recent, 1))

    def layer_share(self, layer: int, num_layers: int) -> float:
        """The layer's budget over the mean layer's (`layers`)."""
        if self.layers == "uniform" or num_layers < 2:
            return 1.0
        return 1.0 + SPREAD * (1.0 - 2.0 * layer / (num_layers - 1))

    def describe(self) -> str:
        size = f"{self.keep:g} of the prompt rows" if self.keep else f"{self.rows} rows"
        schedule = (
            "per layer"
            if self.layers == "uniform"
            else f"per layer on average ({1 + SPREAD:g}× at the first layer to "
            f"{1 - SPREAD:g}× at the last)"
        )
        return (
            f"{size} {schedule} ({self.heads} over its K/V heads), the first {self.sinks} and "
            f"the last {self.recent} always"
        )

    def config(self) -> str:
        size = f"keep={self.keep:g}" if self.keep is not None else f"budget={self.rows}"
        layers = "" if self.layers == "uniform" else f",layers={self.layers}"
        return f"{size},sinks={self.sinks},recent={self.recent},heads={self.heads}{layers}"

    def protected(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [Hkv, T] → the same with the sinks and recent rows at +inf."""
        t = scores.shape[-1]
        position = torch.arange(t, device=scores.device)
        always = (position < self.sinks) | (position >= t - self.recent)  # [T]
        return scores.masked_fill(always, float("inf"))

    def across_layers(self, scores: list[torch.Tensor], count: int) -> list[torch.Tensor]:
        """Each layer's scores [Hkv, T] (one prompt) → the rows each keeps, picked across every
        layer and head by raw score, `count` per head on average: per layer the kept flat
        indices head·T + position [N_l], in order (head-major, position order in a head)."""
        marked = [self.protected(s.float()).reshape(-1) for s in scores]  # [Hkv·T] each
        total = sum(m.shape[0] for m in marked) // scores[0].shape[-1] * count
        chosen = torch.cat(marked).topk(total).indices.sort().values  # [total]
        kept, start = [], 0
        for m in marked:
            end = start + m.shape[0]
            lo, hi = torch.searchsorted(chosen, torch.tensor([start, end], device=chosen.device))
            kept.append(chosen[lo:hi] - start)
            start = end
        return kept

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
