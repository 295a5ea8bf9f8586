"""`standard`: the full K/V cache, optionally a sliding window — the reference every other engine
is measured against.

`window=N` (DESIGN decision 2) is sliding-window attention over N keys including the current
token, on every layer, in prefill (band mask) and decode alike; on an architecture's own sliding
layer the smaller window wins. Each layer keeps only the rows a future query can still see.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from larql.inference.engine import EngineInfo, KvEngine, backend_name
from larql.inference.errors import EmptyPrompt, InvariantViolation
from larql.inference.ffn import FfnBackend
from larql.inference.layer import effective_window, embed, layer_step, token_tensor
from larql.inference.memory import MemoryBreakdown
from larql.kv.buffers import KvBuffer
from larql.models.model import Model


class StandardEngine(KvEngine):
    name = "standard"

    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self.position = 0  # absolute position of the next token
        self._layers: list[KvBuffer] | None = None
        self._backend = "cpu"

    def info(self) -> EngineInfo:
        return EngineInfo(
            name=self.name,
            description=f"full K/V cache per layer ({self.memory().brief()})",
            backend=self._backend,
            config=f"window={self.window}" if self.window else "window=full",
        )

    def memory(self) -> MemoryBreakdown:
        return MemoryBreakdown.of(hot=self._layers or [])

    def window_tokens(self) -> int:
        return len(self._layers[0]) if self._layers else 0

    def supports_multimodal(self) -> bool:
        return True

    def prefill(self, model: Model, ffn: FfnBackend, token_ids: Sequence[int]) -> torch.Tensor:
        return self.prefill_rows(model, ffn, token_ids)[-1:]

    def prefill_rows(self, model: Model, ffn: FfnBackend, token_ids: Sequence[int]) -> torch.Tensor:
        """`prefill` that returns the pre-final-norm hidden of every prompt row [S, H], for
        callers that read positions inside the prompt (boundary frames)."""
        if len(token_ids) == 0:
            raise EmptyPrompt()
        return self._prefill_rows(model, ffn, embed(model, token_tensor(model, token_ids)))

    def prefill_from_hidden(
        self, model: Model, ffn: FfnBackend, initial_hidden: torch.Tensor
    ) -> torch.Tensor:
        return self._prefill_rows(model, ffn, initial_hidden)[-1:]

    def _prefill_rows(
        self, model: Model, ffn: FfnBackend, initial_hidden: torch.Tensor
    ) -> torch.Tensor:
        if initial_hidden.shape[0] == 0:
            raise EmptyPrompt()
        self._backend = backend_name(model)
        self._layers = [self._new_buffer(model, i) for i in range(model.config.num_layers)]
        h = self._run(model, ffn, initial_hidden, start=0)
        self.position = initial_hidden.shape[0]
        return h

    def decode_step(self, model: Model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        self._require_prefill()
        return self.decode_step_from_hidden(
            model, ffn, embed(model, token_tensor(model, [token_id]))
        )

    def decode_step_from_hidden(
        self, model: Model, ffn: FfnBackend, hidden_row: torch.Tensor
    ) -> torch.Tensor:
        self._require_prefill()
        h = self._run(model, ffn, hidden_row, start=self.position)
        self.position += 1
        return h

    def _run(self, model: Model, ffn: FfnBackend, h: torch.Tensor, start: int) -> torch.Tensor:
        assert self._layers is not None
        for layer, buffer in enumerate(self._layers):
            h = layer_step(model, layer, h, start, buffer, ffn, self.window)
            buffer.clip()
        return h

    def _new_buffer(self, model: Model, layer: int) -> KvBuffer:
        # A query sees w keys including itself, so w − 1 rows are all a later token can use.
        w = effective_window(model, layer, self.window)
        return KvBuffer(keep=None if w is None else w - 1)

    def _require_prefill(self) -> None:
        if self._layers is None:
            raise InvariantViolation("decode_step called before prefill")
