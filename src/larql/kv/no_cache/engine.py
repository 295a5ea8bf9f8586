"""`no-cache`: keeps only the token ids and re-runs the whole forward pass every step (O(N²)).
Slow on purpose: it is the oracle the cached engines must agree with.

Its prefill returns every prompt row (it computes them all), so a prompt is scored from its own
pass. For a server, whose turns must stay short, its work also comes in parts
(`prefill_part`, `decode_step_parts`): a pass over the sequence a part of the positions at a
time, through a K/V cache of every layer that lives for that one pass only (`PassInParts`) —
the same pass as one call, up to the order of float sums."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from larql.inference.engine import KvEngine, backend_name
from larql.inference.errors import EmptyPrompt
from larql.inference.ffn import FfnBackend
from larql.inference.forward import run_layers
from larql.inference.layer import embed_rows
from larql.inference.memory import MemoryBreakdown, tensor_bytes
from larql.inference.snapshots import StateReader, StateWriter
from larql.kv.pass_in_parts import PassInParts
from larql.models.model import Model


class NoCacheEngine(KvEngine):
    name = "no-cache"

    def __init__(self) -> None:
        super().__init__()
        self._ids: torch.Tensor | None = None  # [T] int32, the whole canonical state
        self._pass: PassInParts | None = None  # the prompt's pass while more of it follows

    def describe(self) -> str:
        return "no K/V cache — full re-forward per step (O(N²)); correctness oracle"

    def memory(self) -> MemoryBreakdown:
        held = self._pass.nbytes() if self._pass is not None else 0
        return MemoryBreakdown(hot=tensor_bytes(self._ids) + held)

    def window_tokens(self) -> int:
        return 0 if self._ids is None else int(self._ids.shape[0])

    def write_state(self, state: StateWriter) -> None:
        """The token ids: the whole state (a prompt's pass part-way in is a cache of them)."""
        state.tensor("ids", self._ids)  # [T] int32

    def read_state(self, state: StateReader, model: Model) -> None:
        self._ids = state.token_ids("ids", self.position, model.config.vocab_size)
        self._pass = None

    def extends_exactly(self, model: Model) -> bool:
        return True  # a longer pass's last rows, whichever way they are computed

    def step_work(self) -> int:
        return self.position + 1  # every position, the new one included

    def _start_tokens(self, model: Model, ffn: FfnBackend, token_ids: list[int]) -> torch.Tensor:
        self._pass = None
        self._ids = torch.tensor(token_ids, dtype=torch.int32, device=model.device)
        return self._forward(model, ffn)  # [S, H]: every prompt row

    def _step_token(self, model: Model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        self._pass = None
        self._ids = self._with(token_id)
        return self._forward(model, ffn)[-1:]

    def extend_all(self, model: Model, ffn: FfnBackend, token_ids: Sequence[int]) -> torch.Tensor:
        """The new tokens' rows [n, H]: through the prompt's pass where one is held, else the
        last rows of a whole pass."""
        self._require_prefill()
        if len(token_ids) == 0:
            raise EmptyPrompt()
        assert self._ids is not None
        new = torch.tensor(list(token_ids), dtype=torch.int32, device=self._ids.device)
        if self._pass is not None and self._pass.length == self._ids.shape[0]:
            rows = self._pass.run(model, ffn, new)
            self._ids = torch.cat([self._ids, new])
        else:
            self._pass = None
            self._ids = torch.cat([self._ids, new])
            rows = self._forward(model, ffn)[-len(token_ids) :]
        self.position += len(token_ids)
        return rows

    def prefill_part(
        self, model: Model, ffn: FfnBackend, token_ids: Sequence[int], more: bool
    ) -> torch.Tensor:
        """The prompt's next part through one pass kept until its last part → the part's rows
        [n, H]."""
        if self._prefilled:
            rows = self.extend_all(model, ffn, token_ids)
        else:
            if len(token_ids) == 0:
                raise EmptyPrompt()
            self._check_ffn(ffn)
            self._backend = backend_name(model)
            self._ids = torch.tensor(list(token_ids), dtype=torch.int32, device=model.device)
            self._pass = PassInParts(model)
            rows = self._pass.run(model, ffn, self._ids)
            self._started(len(token_ids))
        if not more:
            self._pass = None
        return rows

    def decode_step_parts(
        self, model: Model, ffn: FfnBackend, token_id: int, rows: int
    ) -> Iterator[torch.Tensor | None]:
        """The step's whole pass, `rows` positions a part."""
        self._require_prefill()
        self._pass = None
        ids = self._with(token_id)
        run = PassInParts(model)
        for start in range(0, ids.shape[0], rows):
            hidden = run.run(model, ffn, ids[start : start + rows])
            if start + rows < ids.shape[0]:
                yield None
        self._ids = ids
        self.position += 1
        yield hidden[-1:]

    def _with(self, token_id: int) -> torch.Tensor:
        """The ids with `token_id` after them, [T + 1] int32."""
        assert self._ids is not None
        new = torch.tensor([token_id], dtype=torch.int32, device=self._ids.device)
        return torch.cat([self._ids, new])

    def _forward(self, model: Model, ffn: FfnBackend) -> torch.Tensor:
        """Every position's hidden row [T, H], in one pass."""
        assert self._ids is not None
        h, inputs = embed_rows(model, self._ids.long())  # [T, H], [T, L, P] or None
        return run_layers(model, ffn, h, inputs=inputs)
