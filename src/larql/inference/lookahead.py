"""Batched greedy decode a step ahead: each step is launched before the step before it has been
read, its input tokens taken on the device from that step's picks.

A synchronous step reads its tokens (the host waits for the GPU), then does its bookkeeping
and queues the next step, while the GPU waits for the host. With 64 sessions on the 1B-shaped
model that host time was ~0.9 ms of a ~2.3 ms step. A step ahead, the host's work for step
t + 1 runs while the GPU computes step t.

What it costs: a session is known to have ended only once its step is read, and by then its
next step is queued. That step is taken back (`Engine.withdraw_step`) and its row discarded,
so a session's tokens, its engine's position and its state are those of stepping it alone.
Sessions whose budget ends at a step are not launched past it. Only greedy sessions (the pick
is an argmax on the device) whose engines batch together and can take a step back go ahead.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from larql.inference.batching import decode_batch
from larql.inference.generation import GenerationSession, rows_logits
from larql.inference.host_copy import ints_to_device
from larql.inference.sampling import greedy_tokens
from larql.kernels.ran import recording


@dataclass
class _Launched:
    """A step queued on the device, not yet read."""

    sessions: list[GenerationSession]
    picks: torch.Tensor  # [B] int64 on the device: each row's argmax
    logits: torch.Tensor  # [B, V]
    host: torch.Tensor  # [B] int64 on the host: the picks, once `done`
    done: torch.cuda.Event | None  # recorded after the copy to `host` (None off CUDA)
    withdrawn: set[int] = field(default_factory=set)  # rows taken back: not to be accepted
    rows: dict[int, int] = field(init=False)  # id(gen) → its row

    def __post_init__(self) -> None:
        self.rows = {id(s): i for i, s in enumerate(self.sessions)}

    def row_of(self, gen: GenerationSession) -> int | None:
        """The session's row, None where it has none or it was taken back."""
        row = self.rows.get(id(gen))
        return None if row is None or row in self.withdrawn else row


def goes_ahead(sessions: Sequence[GenerationSession]) -> bool:
    """Whether these sessions can step ahead together: greedy, one model and FFN, engines of
    one batch key that can take a step back."""
    if not sessions:
        return False
    first = sessions[0]
    key = first.engine.batch_key()
    return key is not None and all(
        s.sampler.params.greedy
        and s.model is first.model
        and s.ffn is first.ffn
        and s.engine.batch_key() == key
        and s.engine.withdraws_steps()
        for s in sessions
    )


class Lookahead:
    """Steps sessions a step ahead (see the module). One per group of sessions stepped
    together; `drain` before the sessions are stepped any other way."""

    def __init__(self) -> None:
        self._launched: _Launched | None = None
        self._read_at = time.perf_counter()

    @property
    def in_flight(self) -> list[GenerationSession]:
        """The sessions whose step is queued and not yet read."""
        launched = self._launched
        if launched is None:
            return []
        return [s for i, s in enumerate(launched.sessions) if i not in launched.withdrawn]

    def advance(self, sessions: Sequence[GenerationSession]) -> list[tuple[GenerationSession, int]]:
        """Queue a step for each of `sessions` with a step left in its budget (counting one
        queued), then read the step queued before: → its sessions with the token each got, in
        order (each accepted into its session, as `step()` would). A session that token ends
        has its newly queued step taken back."""
        stepping = [s for s in sessions if self._steps_left(s) > 0]
        launched = self._launch(stepping) if stepping else None
        read = self._read(then_queued=launched)
        self._launched = launched
        return read

    def drain(self) -> list[tuple[GenerationSession, int]]:
        """Read the queued step, queueing none."""
        read = self._read(then_queued=None)
        self._launched = None
        return read

    def withdraw(self, gen: GenerationSession) -> None:
        """The caller ended `session` (a stop string, a client gone): take back its queued
        step, if it has one."""
        launched = self._launched
        row = launched.row_of(gen) if launched is not None else None
        if launched is not None and row is not None:
            gen.engine.withdraw_step()
            launched.withdrawn.add(row)

    def _steps_left(self, gen: GenerationSession) -> int:
        if gen.finished:
            return 0
        queued = self._launched is not None and self._launched.row_of(gen) is not None
        return gen.budget - len(gen.tokens) - int(queued)

    def _launch(self, sessions: list[GenerationSession]) -> _Launched:
        for gen in sessions:
            gen.check_can_step()
        first = sessions[0]
        model, ffn = first.model, first.ffn
        with torch.inference_mode():
            tokens = self._inputs(sessions)  # [B] on the device
            kinds: set[str] = set()
            with recording(kinds):
                hidden = decode_batch([s.engine for s in sessions], model, ffn, tokens)  # [B, H]
            for gen in sessions:
                gen.decode_kinds |= kinds
            logits = rows_logits(model, hidden)  # [B, V]
            picks = greedy_tokens(logits)  # [B]
            done = None
            if picks.device.type == "cuda":
                host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=True)
                host.copy_(picks, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            else:
                host = picks
        return _Launched(list(sessions), picks, logits, host, done)

    def _inputs(self, sessions: list[GenerationSession]) -> torch.Tensor:
        """Each session's last token [B] on the device: from the queued step's picks where it
        is in it (not read yet), else its last accepted token."""
        device = sessions[0].model.device
        launched = self._launched
        rows = [launched.row_of(s) if launched is not None else None for s in sessions]
        if launched is not None and rows == list(range(len(launched.sessions))):
            return launched.picks  # the same sessions in the same order: most steps
        last = [s.tokens[-1] if r is None else 0 for s, r in zip(sessions, rows, strict=True)]
        known = ints_to_device(last, device)
        if launched is None or all(r is None for r in rows):
            return known
        index = ints_to_device([0 if r is None else r for r in rows], device)
        queued = ints_to_device([r is not None for r in rows], device).bool()
        return torch.where(queued, launched.picks.index_select(0, index), known)

    def _read(self, then_queued: _Launched | None) -> list[tuple[GenerationSession, int]]:
        """Wait for the queued step's picks and accept them; a session they end loses its step
        in `then_queued`."""
        launched = self._launched
        if launched is None:
            return []
        if launched.done is not None:
            launched.done.synchronize()
        now = time.perf_counter()
        elapsed = (now - self._read_at) * 1000
        self._read_at = now
        tokens = launched.host.tolist()
        read: list[tuple[GenerationSession, int]] = []
        for i, (gen, token) in enumerate(zip(launched.sessions, tokens, strict=True)):
            if i in launched.withdrawn:
                continue
            gen.logits = launched.logits[i]
            gen.step_ms.append(elapsed)
            gen._accept(token)
            read.append((gen, token))
            if gen.finished and then_queued is not None:
                row = then_queued.row_of(gen)
                if row is not None:
                    gen.engine.withdraw_step()
                    then_queued.withdrawn.add(row)
        return read
