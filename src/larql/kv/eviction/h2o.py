"""`h2o` (Heavy-Hitter Oracle): each layer and K/V head keeps at most `budget` rows — the
`recent` newest, and of the older ones those with the most attention accumulated so far (every
query's softmax weight on the row, summed over the query heads sharing the K/V head). The
prefill attends exactly, then cuts each layer to the budget; every decode step adds its
query's weights and, past the budget, evicts the lightest older row."""

from __future__ import annotations

import torch

from larql.inference.memory import tensor_bytes
from larql.inference.snapshots import StateReader, StateWriter
from larql.kv.eviction.base import EvictingEngine
from larql.kv.eviction.scores import attention_mass, gather_rows
from larql.models.model import Model


class HeavyRows:
    """One layer's kept rows in position order, each K/V head its own: keys, values
    [Hkv, n, D] and their accumulated attention [Hkv, n] float32."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, mass: torch.Tensor) -> None:
        self.keys, self.values, self.mass = keys, values, mass

    def __len__(self) -> int:
        return self.keys.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = torch.cat((self.keys, k), dim=1)
        self.values = torch.cat((self.values, v), dim=1)
        fresh = torch.zeros(k.shape[0], k.shape[1], dtype=self.mass.dtype, device=k.device)
        self.mass = torch.cat((self.mass, fresh), dim=1)
        return self.keys, self.values

    def keep(self, index: torch.Tensor) -> None:
        """index [Hkv, m]: the rows each head keeps, in position order."""
        self.keys = gather_rows(self.keys, index)
        self.values = gather_rows(self.values, index)
        self.mass = torch.gather(self.mass, 1, index)

    def nbytes(self) -> int:
        return tensor_bytes(self.keys, self.values, self.mass)

    def write_state(self, state: StateWriter) -> None:
        state.tensor("k", self.keys)  # [Hkv, n, D]
        state.tensor("v", self.values)
        state.tensor("mass", self.mass)  # [Hkv, n] float32

    @classmethod
    def read_state(
        cls, state: StateReader, count: int, dtype: torch.dtype, heads: int, dim: int
    ) -> HeavyRows:
        keys = state.tensor("k", dtype, (heads, count, dim))
        values = state.tensor("v", dtype, (heads, count, dim))
        return cls(keys, values, state.tensor("mass", torch.float32, (heads, count)))


class H2oEngine(EvictingEngine):
    name = "h2o"

    def __init__(self, budget: int = 512, recent: int = 256, profiling: bool = False) -> None:
        super().__init__(profiling)
        if not 0 <= recent < budget:
            raise ValueError(f"h2o needs 0 ≤ recent < budget, got budget={budget}, recent={recent}")
        self.budget, self.recent = budget, recent

    def describe(self) -> str:
        return (
            f"per layer and K/V head at most {self.budget} rows: the {self.recent} newest and "
            "the heaviest by accumulated attention"
        )

    def config(self) -> str:
        return f"budget={self.budget},recent={self.recent}"

    def _compressed(
        self, model: Model, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> HeavyRows:
        rows = HeavyRows(k, v, attention_mass(model, q, k, 0))
        self._evict(rows)
        return rows

    def _read_kept(self, state: StateReader, dtype: torch.dtype, heads: int, dim: int) -> HeavyRows:
        """At most `budget` rows."""
        return HeavyRows.read_state(state, min(self.position, self.budget), dtype, heads, dim)

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

    def _compressed_from(
        self, model: Model, layer: int, held: object, k: torch.Tensor, v: torch.Tensor
    ) -> HeavyRows:
        assert isinstance(held, torch.Tensor)
        rows = HeavyRows(k, v, held)
        self._evict(rows)
        return rows

    def _attended(self, model: Model, layer: int, rows: HeavyRows, q: torch.Tensor) -> None:
        rows.mass += attention_mass(model, q, rows.keys, len(rows) - 1)
        self._evict(rows)

    def _evict(self, rows: HeavyRows) -> None:
        n = len(rows)
        if n <= self.budget:
            return
        older = n - self.recent  # rows [0, older) compete; the newest `recent` stay
        heavy = rows.mass[:, :older].topk(self.budget - self.recent, dim=-1).indices
        heavy = heavy.sort(dim=-1).values  # [Hkv, budget − recent]
        newest = torch.arange(older, n, device=rows.keys.device).expand(rows.keys.shape[0], -1)
        rows.keep(torch.cat((heavy, newest), dim=1))
