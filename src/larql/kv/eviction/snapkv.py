"""`snapkv`: compress each layer's K/V once, after the prefill. Per K/V head, the `window`
newest prompt rows are kept, and of the rows before them the `budget` that those last
`window` queries attend to most — their summed weights, max-pooled over `kernel` neighbouring
positions so a kept row brings its neighbours' evidence. Decode then appends every new row
and evicts nothing more. A prompt of at most budget + window rows is kept whole (exact)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from larql.inference.snapshots import StateReader
from larql.kv.buffers import KvBuffer
from larql.kv.eviction.base import EvictingEngine
from larql.kv.eviction.scores import attention_mass, gather_rows
from larql.models.model import Model


class SnapKvEngine(EvictingEngine):
    name = "snapkv"
    compresses_once = True

    def __init__(
        self, budget: int = 1024, window: int = 32, kernel: int = 7, profiling: bool = False
    ) -> None:
        super().__init__(profiling)
        if budget < 1 or window < 1 or kernel < 1 or kernel % 2 == 0:
            raise ValueError(
                f"snapkv needs budget ≥ 1, window ≥ 1 and an odd kernel ≥ 1, got "
                f"budget={budget}, window={window}, kernel={kernel}"
            )
        self.budget, self.window, self.kernel = budget, window, kernel

    def describe(self) -> str:
        return (
            f"per layer and K/V head: the {self.budget} prompt rows the last {self.window} "
            f"queries attend to most, those {self.window} rows, and every decoded row"
        )

    def config(self) -> str:
        return f"budget={self.budget},window={self.window},kernel={self.kernel}"

    def _compressed(
        self, model: Model, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> KvBuffer:
        return self._chosen(model, q[:, -self.window :], k, v)

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

    def _compressed_from(
        self, model: Model, layer: int, held: object, k: torch.Tensor, v: torch.Tensor
    ) -> KvBuffer:
        return self._chosen(model, held, k, v)  # type: ignore[arg-type]

    def _chosen(
        self, model: Model, last: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> KvBuffer:
        """The rows kept of a prompt's k, v [Hkv, S, D] by its last `window` queries `last`
        [Hq, window, D] (all of them where the prompt fits the budget and the window)."""
        buffer = KvBuffer()
        prompt = k.shape[1]
        if prompt <= self.budget + self.window:
            buffer.append(k, v)
            return buffer
        observed = prompt - self.window  # rows a selection chooses among: [0, observed)
        mass = attention_mass(model, last, k, observed)[:, :observed]  # [Hkv, n]
        pooled = F.max_pool1d(
            mass.unsqueeze(1), self.kernel, stride=1, padding=self.kernel // 2
        ).squeeze(1)  # [Hkv, observed]
        chosen = pooled.topk(self.budget, dim=-1).indices.sort(dim=-1).values  # [Hkv, budget]
        tail = torch.arange(observed, prompt, device=k.device).expand(k.shape[0], -1)
        index = torch.cat((chosen, tail), dim=1)  # [Hkv, budget + window], positions in order
        buffer.append(gather_rows(k, index), gather_rows(v, index))
        return buffer

    def _read_kept(self, state: StateReader, dtype: torch.dtype, heads: int, dim: int) -> KvBuffer:
        """Every decoded row and what the prompt kept: at least budget + window of the rows (all
        of a shorter prompt's), at most every position."""
        least = min(self.position, self.budget + self.window)
        count = state.row_count("k", least, self.position)
        buffer = KvBuffer()
        buffer.read_state(state, count, dtype, heads, dim)
        return buffer

    def _attended(self, model: Model, layer: int, rows: KvBuffer, q: torch.Tensor) -> None:
        """Nothing more is evicted after the prefill."""
