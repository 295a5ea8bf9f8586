"""`no-cache`: keeps only the token ids and re-runs the whole forward pass every step (O(N²)).
Slow on purpose: it is the oracle the cached engines must agree with."""

from __future__ import annotations

import torch

from larql.inference.engine import KvEngine
from larql.inference.ffn import FfnBackend
from larql.inference.forward import run_layers
from larql.inference.layer import embed_rows
from larql.inference.memory import MemoryBreakdown, tensor_bytes
from larql.inference.snapshots import StateReader, StateWriter
from larql.models.model import Model


class NoCacheEngine(KvEngine):
    name = "no-cache"

    def __init__(self) -> None:
        super().__init__()
        self._ids: torch.Tensor | None = None  # [T] int32, the whole canonical state

    def describe(self) -> str:
        return "no K/V cache — full re-forward per step (O(N²)); correctness oracle"

    def memory(self) -> MemoryBreakdown:
        return MemoryBreakdown(hot=tensor_bytes(self._ids))

    def window_tokens(self) -> int:
        return 0 if self._ids is None else int(self._ids.shape[0])

    def write_state(self, state: StateWriter) -> None:
        state.tensor("ids", self._ids)  # [T] int32

    def read_state(self, state: StateReader, model: Model) -> None:
        self._ids = state.token_ids("ids", self.position, model.config.vocab_size)

    def _start_tokens(self, model: Model, ffn: FfnBackend, token_ids: list[int]) -> torch.Tensor:
        self._ids = torch.tensor(token_ids, dtype=torch.int32, device=model.device)
        return self._forward(model, ffn)

    def _step_token(self, model: Model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        assert self._ids is not None
        new = torch.tensor([token_id], dtype=torch.int32, device=self._ids.device)
        self._ids = torch.cat([self._ids, new])
        return self._forward(model, ffn)

    def _forward(self, model: Model, ffn: FfnBackend) -> torch.Tensor:
        assert self._ids is not None
        h, inputs = embed_rows(model, self._ids.long())  # [T, H], [T, L, P] or None
        return run_layers(model, ffn, h, inputs=inputs)[-1:]
