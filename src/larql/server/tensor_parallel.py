"""`larql serve --tensor-parallel N`: rank 0 serves HTTP and schedules; the other ranks run
the same model work on their shares.

Rank 0's scheduler hands every call that runs the model to `MirroredSteps`, which first
broadcasts it (which session, which call, its argument: a few numbers) to the other ranks and
then runs it; each other rank (`follow`) receives the calls in the same order and runs each on
its own copy of the sessions, so the all-reduces inside the layers pair up. A session's
opening (its engine spec, prompt, sampling) and its end travel with the next call. The ranks'
logits are the same, and a sampled token is rank 0's on every rank (`AgreedSampler`), so every
rank's sessions hold the same tokens without sending them.

Every collective waits at most the group's timeout. While no session runs, rank 0 sends a
heartbeat every `HEARTBEAT_S`, so an idle server also finds a rank that died, and the other
ranks never wait past the timeout for work: a rank that dies or stops answering ends the
server with an error (`RankFailed`), never a hang."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

from larql.inference.engine import Engine
from larql.inference.ffn import DenseFfn, FfnBackend
from larql.inference.generation import GenerationSession
from larql.kv.catalog import parse_engine
from larql.models.model import Model
from larql.models.shard import RankFailed, TensorParallelError, TensorShard
from larql.server.steps import Opening, Steps

log = logging.getLogger("larql.server")

# seconds between rank 0's heartbeats while no session runs (well inside the collectives'
# timeout, so a waiting rank always hears from rank 0 in time)
HEARTBEAT_S = 5.0

Call = tuple[Any, ...]  # (name, session id or ids, argument…)


class MirroredSteps(Steps):
    """Rank 0's `Steps`: each model call is broadcast to the other ranks, then run here."""

    may_go_ahead = False  # a step queued ahead would run its all-reduces out of order

    def __init__(self, shard: TensorShard, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.shard = shard
        self.idle_s = heartbeat_s
        self._ids: dict[GenerationSession, int] = {}
        self._next_id = 0
        self._pending: list[Call] = []  # openings and ends, sent with the next call
        self._lock = threading.Lock()
        self._finished = False

    def open(
        self, opening: Opening, engine: Engine, model: Model, ffn: FfnBackend
    ) -> GenerationSession:
        if opening.resumes:  # (the CLI turns the prefix cache off: its copies are rank 0's)
            raise TensorParallelError("a tensor-parallel server keeps no prefix cache")
        generation = super().open(opening, engine, model, ffn)
        with self._lock:
            self._ids[generation] = self._next_id
            self._pending.append(("open", self._next_id, opening))
            self._next_id += 1
        return generation

    def close(self, generation: GenerationSession) -> None:
        with self._lock:
            sid = self._ids.pop(generation, None)
            if sid is not None:
                self._pending.append(("close", sid))

    def prefill_part(self, generation: GenerationSession, max_tokens: int) -> int | None:
        self._send(("prefill_part", self._id(generation), max_tokens))
        return super().prefill_part(generation, max_tokens)

    def feed_prompt(self, generation: GenerationSession, max_tokens: int) -> bool:
        self._send(("feed_prompt", self._id(generation), max_tokens))
        return super().feed_prompt(generation, max_tokens)

    def step_part(self, generation: GenerationSession, max_rows: int) -> int | None:
        self._send(("step_part", self._id(generation), max_rows))
        return super().step_part(generation, max_rows)

    def step_together(self, generations: Sequence[GenerationSession]) -> list[int]:
        self._send(("step_together", [self._id(g) for g in generations]))
        return super().step_together(generations)

    def advance_together(
        self, generations: Sequence[GenerationSession], chunks: Sequence[int]
    ) -> list[int | None]:
        self._send(("advance_together", [self._id(g) for g in generations], list(chunks)))
        return super().advance_together(generations, chunks)

    def idle(self) -> None:
        self._send(("heartbeat",))

    def finish(self) -> None:
        """The other ranks stop following (once; a failed group is left as it is)."""
        if self._finished:
            return
        self._finished = True
        try:
            self._send(("stop",))
        except RankFailed as e:  # (a rank is gone: what found it says so)
            log.debug("the other ranks could not be told to stop: %s", e)

    def _id(self, generation: GenerationSession) -> int:
        with self._lock:
            return self._ids[generation]

    def _send(self, call: Call) -> None:
        with self._lock:
            calls, self._pending = [*self._pending, call], []
        self.shard.share(calls)


def follow(model: Model, shard: TensorShard) -> None:
    """A rank other than 0: run rank 0's model calls on this rank's sessions until it says
    stop. Rank 0 decides everything (which sessions, when they end); a call that fails here
    fails there too and rank 0 ends its sessions, so the failure is only logged. A failed
    collective (`RankFailed`) ends this rank with its error."""
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C in the terminal reaches every rank: rank 0 shuts down and tells this one
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    steps, ffn = Steps(), DenseFfn(model)
    sessions: dict[int, GenerationSession] = {}
    while True:
        for call in shard.share(None):
            if call[0] == "stop":
                return
            _run_call(call, steps, model, ffn, sessions)


def _run_call(
    call: Call,
    steps: Steps,
    model: Model,
    ffn: DenseFfn,
    sessions: dict[int, GenerationSession],
) -> None:
    name = call[0]
    if name == "heartbeat":
        return
    if name == "open":
        _, sid, opening = call
        engine = parse_engine(opening.engine_spec).build(model)
        sessions[sid] = steps.open(opening, engine, model, ffn)
        return
    if name == "close":
        sessions.pop(call[1], None)
        return
    if name not in _CALLS:
        raise TensorParallelError(f"rank 0 sent an unknown call {name!r}")
    ids = call[1] if isinstance(call[1], list) else [call[1]]
    missing = [sid for sid in ids if sid not in sessions]
    if missing:
        raise TensorParallelError(
            f"this rank has no session {missing[0]} that rank 0 stepped ({name}): the ranks "
            "no longer hold the same sessions"
        )
    mine = [sessions[sid] for sid in ids]
    try:
        _CALLS[name](steps, mine, *call[2:])
    except (RankFailed, TensorParallelError):
        raise
    except Exception as e:
        if isinstance(e.__cause__, RankFailed):
            raise e.__cause__ from None
        log.debug("a call of rank 0 failed here too (%s): %s", name, e)


# what each call runs on this rank's sessions (a call on one session names it alone)
_CALLS: dict[str, Callable[..., object]] = {
    "prefill_part": lambda steps, mine, n: steps.prefill_part(mine[0], n),
    "feed_prompt": lambda steps, mine, n: steps.feed_prompt(mine[0], n),
    "step_part": lambda steps, mine, rows: steps.step_part(mine[0], rows),
    "step_together": lambda steps, mine: steps.step_together(mine),
    "advance_together": lambda steps, mine, chunks: steps.advance_together(mine, chunks),
}
