"""The engine protocol: `KvEngine` (keeps decode state, takes an FFN backend), `RetrievalEngine`
(its sibling, no FFN, no K/V) and `AnyEngine` (the one type the harnesses hold). Their typed
failures are in `errors`.

Output contract: `prefill` and `decode_step` return the pre-final-norm hidden state of the last
position, shape [1, H]; the caller turns it into logits with `layer.final_logits`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from larql.inference.errors import BackendUnavailable, EmptyPrompt
from larql.inference.ffn import FfnBackend
from larql.inference.layer import embed, token_tensor
from larql.inference.memory import MemoryBreakdown
from larql.inference.profiling import DecodeStageSummary
from larql.models.model import Model

# ---------------------------------------------------------------------------- descriptions


@dataclass(frozen=True)
class EngineInfo:
    name: str
    description: str
    backend: str
    config: str = ""

    def summary(self) -> str:
        if self.config:
            return f"{self.name} [{self.backend}] ({self.config})  {self.description}"
        return f"{self.name} [{self.backend}]  {self.description}"


def backend_name(model: Model) -> str:
    return model.device.type


# ---------------------------------------------------------------------------- protocols


class _EngineBase(ABC):
    """What both engine kinds share: identity, memory, profiling hooks."""

    name: str = ""

    @abstractmethod
    def info(self) -> EngineInfo: ...

    @abstractmethod
    def memory(self) -> MemoryBreakdown: ...

    def memory_bytes(self) -> int:
        """Everything held: the state and the growth reserve (`memory()` splits them)."""
        return self.memory().total

    def cold_bytes(self) -> int:
        return self.memory().cold

    def window_tokens(self) -> int:
        """Tokens in the engine's active (hot) window."""
        return 0

    def stage_summary(self) -> DecodeStageSummary | None:
        return None

    def dispatch_path(self) -> str | None:
        return "per-layer"


class KvEngine(_EngineBase):
    """Keeps decode state across tokens; the FFN is whatever backend the caller hands in."""

    def prefill(self, model: Model, ffn: FfnBackend, token_ids: Sequence[int]) -> torch.Tensor:
        """Run the prompt; return the last position's pre-final-norm hidden [1, H].

        By default: embed the ids and `prefill_from_hidden` (engines that cannot start from
        hidden rows override this instead)."""
        if len(token_ids) == 0:
            raise EmptyPrompt()
        return self.prefill_from_hidden(model, ffn, embed(model, token_tensor(model, token_ids)))

    @abstractmethod
    def decode_step(self, model: Model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        """Append one token at the next absolute position; return its hidden [1, H]."""

    def supports_multimodal(self) -> bool:
        return False

    def prefill_from_hidden(
        self, model: Model, ffn: FfnBackend, initial_hidden: torch.Tensor
    ) -> torch.Tensor:
        """Prefill from given input rows [N, H] (e.g. image embeddings) instead of token ids."""
        raise BackendUnavailable(f"{self.name} cannot prefill from hidden states")

    def decode_step_from_hidden(
        self, model: Model, ffn: FfnBackend, hidden_row: torch.Tensor
    ) -> torch.Tensor:
        raise BackendUnavailable(f"{self.name} cannot decode from a hidden state")


class RetrievalEngine(_EngineBase):
    """Serves from a store instead of keeping K/V; takes no FFN backend."""

    @abstractmethod
    def prefill(self, model: Model, token_ids: Sequence[int]) -> torch.Tensor: ...

    @abstractmethod
    def decode_step(self, model: Model, token_id: int) -> torch.Tensor: ...


class AnyEngine:
    """A `KvEngine` or a `RetrievalEngine` behind one interface (the harness boundary)."""

    def __init__(self, engine: KvEngine | RetrievalEngine) -> None:
        self.inner = engine

    @property
    def is_kv(self) -> bool:
        return isinstance(self.inner, KvEngine)

    @property
    def is_retrieval(self) -> bool:
        return isinstance(self.inner, RetrievalEngine)

    @property
    def name(self) -> str:
        return self.inner.name

    def info(self) -> EngineInfo:
        return self.inner.info()

    def memory(self) -> MemoryBreakdown:
        return self.inner.memory()

    def memory_bytes(self) -> int:
        return self.inner.memory_bytes()

    def cold_bytes(self) -> int:
        return self.inner.cold_bytes()

    def window_tokens(self) -> int:
        return self.inner.window_tokens()

    def stage_summary(self) -> DecodeStageSummary | None:
        return self.inner.stage_summary()

    def dispatch_path(self) -> str | None:
        return self.inner.dispatch_path()

    def supports_multimodal(self) -> bool:
        return isinstance(self.inner, KvEngine) and self.inner.supports_multimodal()

    def prefill(self, model: Model, ffn: FfnBackend, token_ids: Sequence[int]) -> torch.Tensor:
        if isinstance(self.inner, KvEngine):
            return self.inner.prefill(model, ffn, token_ids)
        return self.inner.prefill(model, token_ids)

    def decode_step(self, model: Model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        if isinstance(self.inner, KvEngine):
            return self.inner.decode_step(model, ffn, token_id)
        return self.inner.decode_step(model, token_id)

    def prefill_from_hidden(
        self, model: Model, ffn: FfnBackend, initial_hidden: torch.Tensor
    ) -> torch.Tensor:
        if isinstance(self.inner, KvEngine):
            return self.inner.prefill_from_hidden(model, ffn, initial_hidden)
        raise BackendUnavailable(f"{self.name} is a retrieval engine: no prefill from hidden")
