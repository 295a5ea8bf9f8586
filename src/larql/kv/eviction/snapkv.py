"""`snapkv`: compress each layer's K/V once, after the prefill, by what the prompt's last
`window` queries attend to — their summed weights per K/V head, max-pooled over `kernel`
neighbouring positions so a kept row brings its neighbours' evidence. The window's own rows
are always kept; decode then appends every new row and evicts nothing more. A prompt of at
most budget + window rows is kept whole (exact).

Query-aware when the question is inside the window (the end of the prompt): the window's
queries are then the question's, and vote for the rows that answer it. Compressing before the
question is seen (compress once, ask many), the votes are the context's own last sentences'."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from larql.kv.eviction.budget import Budget
from larql.kv.eviction.scores import attention_mass
from larql.kv.eviction.scoring import ScoringEngine
from larql.models.model import Model


class SnapKvEngine(ScoringEngine):
    name = "snapkv"

    def __init__(
        self,
        budget: int = 1024,
        window: int = 32,
        kernel: int = 7,
        profiling: bool = False,
        keep: float | None = None,
        sinks: int = 0,
        heads: str = "uniform",
        layers: str = "uniform",
    ) -> None:
        if budget < 1 or window < 1 or kernel < 1 or kernel % 2 == 0:
            raise ValueError(
                f"snapkv needs budget ≥ 1, window ≥ 1 and an odd kernel ≥ 1, got "
                f"budget={budget}, window={window}, kernel={kernel}"
            )
        rows = None if keep is not None else budget + window
        super().__init__(Budget(keep, rows, sinks, window, heads, layers), profiling)  # type: ignore[arg-type]
        self.window, self.kernel = window, kernel

    def scorer(self) -> str:
        return (
            f"the rows the last {self.window} prompt queries attend to most (max-pooled over "
            f"{self.kernel}), every decoded row"
        )

    def scorer_config(self) -> str:
        return f"window={self.window},kernel={self.kernel}"

    def _observe(
        self,
        model: Model,
        layer: int,
        held: object,
        q: torch.Tensor,
        start: int,
        keys: torch.Tensor,
    ) -> torch.Tensor:
        """The last `window` queries so far [Hq, ≤ window, D]."""
        last = q if held is None else torch.cat((held, q), dim=1)  # type: ignore[arg-type]
        return last[:, -self.window :]

    def _row_scores(
        self, model: Model, layer: int, held: object, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        assert isinstance(held, torch.Tensor)
        observed = k.shape[1] - held.shape[1]  # rows before the window (which is kept)
        mass = attention_mass(model, held, k, observed)  # [Hkv, T]
        pooled = F.max_pool1d(
            mass[:, :observed].unsqueeze(1), self.kernel, stride=1, padding=self.kernel // 2
        ).squeeze(1)  # [Hkv, observed]: the window's own votes left out of the pooling
        return torch.cat((pooled, mass[:, observed:]), dim=1)  # [Hkv, T]
