"""`no-cache`: keeps only the token ids and re-runs the whole forward pass every step (O(N²)).
Slow on purpose: it is the oracle the cached engines must agree with."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from larql.inference.engine import EngineInfo, KvEngine, backend_name
from larql.inference.errors import EmptyPrompt, InvariantViolation
from larql.inference.ffn import FfnBackend
from larql.inference.forward import run_layers
from larql.inference.layer import embed
from larql.inference.memory import MemoryBreakdown, tensor_bytes


class NoCacheEngine(KvEngine):
    name = "no-cache"

    def __init__(self) -> None:
        self._ids: torch.Tensor | None = None  # [T] int32, the whole canonical state
        self._backend = "cpu"

    def info(self) -> EngineInfo:
        return EngineInfo(
            name=self.name,
            description="no K/V cache — full re-forward per step (O(N²)); correctness oracle",
            backend=self._backend,
        )

    def memory(self) -> MemoryBreakdown:
        return MemoryBreakdown(hot=tensor_bytes(self._ids))

    def window_tokens(self) -> int:
        return 0 if self._ids is None else int(self._ids.shape[0])

    def prefill(self, model, ffn: FfnBackend, token_ids: Sequence[int]) -> torch.Tensor:
        if len(token_ids) == 0:
            raise EmptyPrompt()
        self._backend = backend_name(model)
        self._ids = torch.tensor(list(token_ids), dtype=torch.int32, device=model.device)
        return self._forward(model, ffn)

    def decode_step(self, model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        if self._ids is None:
            raise InvariantViolation("decode_step called before prefill")
        new = torch.tensor([token_id], dtype=torch.int32, device=self._ids.device)
        self._ids = torch.cat([self._ids, new])
        return self._forward(model, ffn)

    def _forward(self, model, ffn: FfnBackend) -> torch.Tensor:
        assert self._ids is not None
        h = run_layers(model, ffn, embed(model, self._ids.long()))
        return h[-1:]
