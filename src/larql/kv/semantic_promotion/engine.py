"""`semantic-promotion`: a policy wrapper over another KV engine (`base=SPEC`).

A promotion policy decides which rows of a base engine's state to keep at higher fidelity. Only
its observe mode exists: the wrapper runs its base unchanged — every call, state and output is
the base's, bit for bit — and counts what it saw (prompt tokens and decode steps). Enforcing
modes would change the base's state and are refused where the spec is parsed."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence

import torch

from larql.inference.engine import Engine, KvEngine
from larql.inference.ffn import FfnBackend
from larql.inference.memory import MemoryBreakdown
from larql.inference.profiling import DecodeStageSummary
from larql.inference.snapshots import StateReader, StateWriter, restore_into
from larql.models.model import Model


class SemanticPromotionEngine(KvEngine):
    name = "semantic-promotion"

    def __init__(self, base: Engine, base_spec: str, mode: str = "observe") -> None:
        super().__init__()
        self.base, self.base_spec, self.mode = base, base_spec, mode
        self.observed_prompt_tokens = 0
        self.observed_steps = 0

    # ------------------------------------------------------------------ what it holds: the base's

    def memory(self) -> MemoryBreakdown:
        return self.base.memory()

    def describe(self) -> str:
        return (
            f"observes {self.base.info().label} (a policy wrapper: the base's state and outputs "
            f"unchanged; {self.observed_prompt_tokens} prompt tokens, {self.observed_steps} steps "
            "seen)"
        )

    def config(self) -> str:
        return f"base={self.base_spec},mode={self.mode}"

    def window_tokens(self) -> int:
        return self.base.window_tokens()

    def stage_summary(self) -> DecodeStageSummary | None:
        return self.base.stage_summary()

    def dispatch_path(self) -> str | None:
        return self.base.dispatch_path()

    def supports_multimodal(self) -> bool:
        return self.base.supports_multimodal()

    def extends_exactly(self, model: Model) -> bool:
        return self.base.extends_exactly(model)

    def snapshot_refusal(self) -> str | None:
        return self.base.snapshot_refusal()

    def prompt_part_way(self) -> bool:
        return self.base.prompt_part_way()

    def write_state(self, state: StateWriter) -> None:
        """Its base's state (`base.*`) and what it has seen."""
        self.base.write_state(state.scope("base"))
        state.put("observed_prompt_tokens", self.observed_prompt_tokens)
        state.put("observed_steps", self.observed_steps)

    def read_state(self, state: StateReader, model: Model) -> None:
        self.base = copy.copy(self.base)  # (a fork's base must not be the original's)
        restore_into(self.base, state.scope("base"), model, self.position)
        self.observed_prompt_tokens = state.integer("observed_prompt_tokens", 0, self.position)
        self.observed_steps = state.integer("observed_steps", 0, self.position)

    # ------------------------------------------------------------------ the protocol, delegated

    def prefill_all(self, model: Model, ffn: FfnBackend, token_ids: Sequence[int]) -> torch.Tensor:
        rows = self.base.prefill_all(model, ffn, token_ids)
        self._saw(prompt=len(token_ids))
        return rows

    def prefill_from_hidden(
        self, model: Model, ffn: FfnBackend, initial_hidden: torch.Tensor
    ) -> torch.Tensor:
        rows = self.base.prefill_from_hidden(model, ffn, initial_hidden)
        self._saw(prompt=initial_hidden.shape[0])
        return rows

    def extend_all(self, model: Model, ffn: FfnBackend, token_ids: Sequence[int]) -> torch.Tensor:
        rows = self.base.extend_all(model, ffn, token_ids)
        self._saw(prompt=len(token_ids))
        return rows

    def takes_prompt_in_parts(self, model: Model) -> bool:
        return self.base.takes_prompt_in_parts(model)

    def prefill_part(
        self, model: Model, ffn: FfnBackend, token_ids: Sequence[int], more: bool
    ) -> torch.Tensor:
        rows = self.base.prefill_part(model, ffn, token_ids, more)
        self._saw(prompt=len(token_ids))
        return rows

    def finish_prompt(self, rows: int) -> bool:
        return self.base.finish_prompt(rows)

    def step_work(self) -> int:
        return self.base.step_work()

    def decode_step_parts(
        self, model: Model, ffn: FfnBackend, token_id: int, rows: int
    ) -> Iterator[torch.Tensor | None]:
        for part in self.base.decode_step_parts(model, ffn, token_id, rows):
            if part is not None:
                self._saw(steps=1)
            yield part

    def decode_step(self, model: Model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        hidden = self.base.decode_step(model, ffn, token_id)
        self._saw(steps=1)
        return hidden

    def decode_step_from_hidden(
        self, model: Model, ffn: FfnBackend, hidden_row: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.base.decode_step_from_hidden(model, ffn, hidden_row)
        self._saw(steps=1)
        return hidden

    def _saw(self, prompt: int = 0, steps: int = 0) -> None:
        self.observed_prompt_tokens += prompt
        self.observed_steps += steps
        self.position = self.base.position
        self._prefilled = True
        self._backend = self.base._backend
