"""`ScoredRows`: one layer's kept rows in position order, every K/V head the same count, each
row with the score a policy that evicts as it decodes (`h2o`, `tova`) reads: keys, values
[Hkv, n, D] and score [Hkv, n] float32."""

from __future__ import annotations

import torch

from larql.inference.memory import tensor_bytes
from larql.inference.snapshots import StateReader, StateWriter
from larql.kv.eviction.scores import gather_rows


class ScoredRows:
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, score: torch.Tensor) -> None:
        self.keys, self.values, self.score = keys, values, score

    def __len__(self) -> int:
        return self.keys.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = torch.cat((self.keys, k), dim=1)
        self.values = torch.cat((self.values, v), dim=1)
        fresh = torch.zeros(k.shape[0], k.shape[1], dtype=self.score.dtype, device=k.device)
        self.score = torch.cat((self.score, fresh), dim=1)
        return self.keys, self.values

    def keep(self, index: torch.Tensor) -> None:
        """index [Hkv, m]: the rows each head keeps, in position order."""
        self.keys = gather_rows(self.keys, index)
        self.values = gather_rows(self.values, index)
        self.score = torch.gather(self.score, 1, index)

    def nbytes(self) -> int:
        return tensor_bytes(self.keys, self.values, self.score)

    def write_state(self, state: StateWriter) -> None:
        state.tensor("k", self.keys.transpose(0, 1))  # [n, Hkv, D]
        state.tensor("v", self.values.transpose(0, 1))
        state.tensor("score", self.score.transpose(0, 1))  # [n, Hkv] float32

    @classmethod
    def read_state(
        cls, state: StateReader, position: int, dtype: torch.dtype, heads: int, dim: int
    ) -> ScoredRows:
        """At most `position` rows, at least one."""
        count = state.row_count("k", min(1, position), position)
        keys = state.rows("k", dtype, count, (heads, dim))
        values = state.rows("v", dtype, count, (heads, dim))
        score = state.rows("score", torch.float32, count, (heads,))
        return cls(keys.transpose(0, 1), values.transpose(0, 1), score.transpose(0, 1))
