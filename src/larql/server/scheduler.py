"""One model, many streams: a scheduler thread steps the active sessions, continuously batched.

Each session is a `GenerationSession` (the loop `larql run` uses) over its own engine: its first
turns put its prompt in, every later turn is one decode step, so every stream progresses and
none waits for another to finish. Sessions whose engines batch together (equal `batch_key`:
same engine family and settings) take their decode step together, one forward pass for all of
them, so the weights are read once per step instead of once per stream; streams join the
running batch after their prefill and leave it when they end, at any step. Groups of different
engines take turns. At most `max_sessions` decode at once; up to `max_queue` more wait in order
behind them; beyond that `submit` raises `QueueFull` (the HTTP layer answers 429).

Bounded turns. No turn does work that grows with one request's size: a prompt goes in
`prefill_chunk` tokens a turn (riding in the running streams' step where its engine batches
with theirs, else in a turn of its own between their steps; `SOLO_TURN_CHUNKS` times that with
no stream decoding), its log-probabilities (echo) scored from each part's rows as they come,
and the work an engine's policy does on the whole prompt (coding, evicting) goes in parts
after it (`Engine.finish_prompt`);
an engine whose decode step recomputes from the whole context (`no-cache`, `markov-rs` without
K/V) takes its step in parts of as many rows (`Engine.decode_step_parts`). Deadlines
(`request_timeout_s`), cancellation (a client gone) and shutdown are checked between turns,
so each takes effect within one part. Every live engine takes a prompt in parts
(`Engine.takes_prompt_in_parts`) except on CUDA's fixed-slot paths (`standard`'s static graph
path, `turbo-quant`'s kernel path), which take it in one turn.

Isolation. One session's failure ends that session only:
- Before a step shared by several sessions, each is checked (`_ready`): a cancelled or
  timed-out session leaves, and so does one whose state is not where its tokens say
  (`GenerationSession.state_fault`: finished, or its engine's position is not its tokens'),
  with an error of its own; the others step without it.
- Inside a shared step, each engine's own part (its attention over its own state: the torch
  paths of `standard`, `turbo-quant`/`kv-quant`, and `markov-rs`' per-engine steps) runs
  isolated: where it raises, that session ends with the error and the others' rows, which no
  shared part mixes, give them the tokens they would have had
  (`batching.IsolatedRows`, `generation.SessionsFailed`).
- Where a part every session shares fails (a projection, the FFN, the LM head, a compiled
  call over all sessions, a captured CUDA graph), the engine class puts every engine back as
  it was before the step where it can (`standard` without a window, eager or static:
  `batching.StepRolledBack`), and each session then takes that step alone, so only a session
  whose own step fails ends.
- Anything else a turn raises (a bug outside those guarded parts, in picking a step or around
  it) ends the sessions of that turn with a 500 error, and the loop goes on with the rest:
  the scheduler thread never dies of one turn, so no stream waits forever on it.
Not isolated: a shared part's failure for engines that cannot roll a step back (a windowed
`standard`, `markov-rs`' and `turbo-quant`'s compiled all-sessions calls, `turbo-quant`'s CUDA
kernel step) ends every session in that step; on CUDA, a step queued ahead that fails on the
device ends every session with a step in flight. Those are the server's failures (a bug, the
device), never one request's data: requests are checked before they are queued.

The compute runs on the scheduler's thread, never on the event loop: a thread of its own, or
(`larql serve`) the process's main thread, through `claim_this_thread` + `run`. The main thread
is better: torch's OpenMP runtime spins its workers between parallel regions only while it
manages no more threads than there are CPUs, and a second thread's pool beside the main
thread's breaks that on a small machine (a decode step in a second thread took twice as long
on 2 cores). Tokens travel to the request's coroutine through an `asyncio.Queue` fed with
`call_soon_threadsafe`. A cancelled session (its client went away) is dropped before the next
step of any session, which frees its engine.

The model work of a turn (a session's generation made, a part of its prompt, a decode step, a
batched step) goes through `Steps` (`larql.server.steps`): in one process it runs here; under
tensor parallelism rank 0's `MirroredSteps` has every rank run the same call
(`larql.server.tensor_parallel`). A failed collective there (`RankFailed`) is the server's
failure, not a session's: every session ends with a 503 error event and the loop stops with it.

Shutdown (`begin_shutdown`): new sessions are refused and queued ones end at once; running
ones go on until they finish or `shutdown_timeout_s` passes, then end with an error event, so
their streams end cleanly instead of being cut.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from larql.errors import LarqlError
from larql.inference.batching import StepRolledBack
from larql.inference.decode_path import decode_path
from larql.inference.engine import Engine
from larql.inference.errors import BackendUnavailable, EngineError
from larql.inference.ffn import FfnBackend
from larql.inference.generation import FinishReason, GenerationSession, SessionsFailed
from larql.inference.linear import rows_per_pass
from larql.inference.logprobs import PromptScorer, TokenLogprob, token_logprob
from larql.inference.lookahead import Lookahead, goes_ahead
from larql.inference.memory import MemoryBreakdown
from larql.inference.prefix_cache import PART_STATES_EVERY, CachedStart, PrefixCache
from larql.inference.sampling import SamplingParams
from larql.models.model import Model
from larql.models.shard import RankFailed
from larql.server.logprobs import Entry, GeneratedTrack
from larql.server.metrics import ServerMetrics
from larql.server.steps import Opening, Steps
from larql.server.text import TextAssembler

log = logging.getLogger("larql.server")


@dataclass(frozen=True)
class SessionRequest:
    """A validated request: what to generate and with which engine (a spec, not state)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    engine_spec: str  # canonical spec, shown to the client
    engine_name: str  # catalog name, the metrics label
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives per token; None: no log-probabilities
    echo: bool = False  # the prompt goes first (scored too with logprobs); may generate nothing
    streamed: bool = True  # its tokens go out as they come (else all at once, with its end)

    @property
    def scores_prompt(self) -> bool:
        return self.echo and self.logprobs is not None


@dataclass(frozen=True)
class PromptEvent:
    """An echoed prompt's log-probabilities (of every token after the first; empty without
    logprobs), before any generated token."""

    logprobs: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class TokenEvent:
    text: str  # a non-empty piece of the generated text
    logprobs: tuple[Entry, ...] = ()  # the tokens whose text is now out (offsets: generated text)


@dataclass(frozen=True)
class DoneEvent:
    finish_reason: FinishReason
    prompt_tokens: int
    token_ids: tuple[int, ...]
    memory: MemoryBreakdown  # what the engine held at the end of the generation
    logprobs: tuple[Entry, ...] = ()  # the tokens no TokenEvent carried (a stop token, …)


@dataclass(frozen=True)
class ErrorEvent:
    status: int
    message: str
    type: str
    code: str | None = None


Event = PromptEvent | TokenEvent | DoneEvent | ErrorEvent


def error_event(error: LarqlError) -> ErrorEvent:
    """A typed error inside a session: the engine's own failures are the server's fault (5xx),
    anything else was asked for (4xx)."""
    if isinstance(error, BackendUnavailable):
        return ErrorEvent(503, str(error), "server_error")
    if isinstance(error, EngineError) and not error.recoverable:
        return ErrorEvent(500, str(error), "server_error")
    return ErrorEvent(400, str(error), "invalid_request_error")


class QueueFull(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__("the server is at capacity")
        self.retry_after_s = retry_after_s


class SchedulerClosed(Exception):
    pass


@dataclass(frozen=True)
class SchedulerLimits:
    max_sessions: int = 4
    max_queue: int = 16
    request_timeout_s: float = 300.0
    retry_after_s: int = 1
    # new prompts' tokens one step takes in while other sessions decode (riding in their step,
    # or in a turn of its own between their steps); a step that recomputes from the context
    # takes as many rows of work a turn
    prefill_chunk: int = 32
    # seconds running sessions may go on after shutdown begins, before they end
    shutdown_timeout_s: float = 10.0


# With no stream decoding, a turn of its own takes this many `prefill_chunk`s: fewer turns for
# a long prompt alone, each still short enough that deadlines, cancellation and shutdown are
# seen between them.
SOLO_TURN_CHUNKS = 4


class Session:
    """One request's generation; only the scheduler thread touches its engine."""

    def __init__(
        self,
        request: SessionRequest,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        text: TextAssembler,
        timeout_s: float,
    ) -> None:
        self.request = request
        self.engine: Engine | None = engine
        self.generation: GenerationSession | None = None
        self.text = text
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.arrived = time.perf_counter()
        self.deadline = self.arrived + timeout_s
        self.last_token_at = self.arrived
        self.memory = MemoryBreakdown()
        self.track = GeneratedTrack()
        self.cancelled = False
        self.ended = False
        self.prefill_chunk = 0  # this turn's prompt tokens
        self.part_cached = 0  # prompt tokens the last part-way state offered to the cache held
        self.step_rows = 1  # rows of work this turn's decode step may do (a step in parts)
        self.scorer: PromptScorer | None = None  # an echoed prompt's scores, as parts go in
        self.held: list[TokenEvent] = []  # an unstreamed request's pieces, until its end
        # what ran, noted as it ends (`larql serve -v` logs it): prompt tokens taken from the
        # prefix cache, tokens generated, the decode path of its steps
        self.cached_tokens = 0
        self.generated = 0
        self.decode_path: str | None = None
        self._loop = loop

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    def emit(self, event: Event) -> None:
        """Hand `event` to the request's coroutine. An unstreamed request's text pieces wait
        here for its end: its answer is one body, and waking the event loop for every token
        of every such stream takes a core from the step beside it (on a 2-core CPU, eight
        unstreamed streams' steps took ~1 ms longer)."""
        if isinstance(event, TokenEvent) and not self.request.streamed:
            self.held.append(event)
            return
        if self.held:
            held, self.held = self.held, []
            for piece in held:
                self._hand_over(piece)
        self._hand_over(event)

    def _hand_over(self, event: Event) -> None:
        collected = getattr(_turn, "events", None)
        if collected is not None:  # the scheduler's turn: handed over when the turn ends
            collected.append((self, event))
            return
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            self.cancelled = True


# The events of the scheduler's current turn: one step emits a token to every stream in it, and
# handing each over on its own wakes the event loop once per stream per step (a syscall each,
# 64 per step at 64 streams); `_turn_events` hands a turn's events over in one call per loop.
_turn = threading.local()


class _turn_events:
    """Collect the `Session.emit`s of this thread's turn; deliver them in order at its end."""

    def __enter__(self) -> None:
        _turn.events = []

    def __exit__(self, *exc: object) -> None:
        events: list[tuple[Session, Event]] = _turn.events
        _turn.events = None
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Session, Event]]] = {}
        for stream, event in events:
            by_loop.setdefault(stream._loop, []).append((stream, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is gone: nobody is listening any more
                for stream, _ in items:
                    stream.cancelled = True


def _put_all(items: list[tuple[Session, Event]]) -> None:
    for stream, event in items:
        stream.events.put_nowait(event)


# a live session's held bytes (the memory gauge) are re-read every this many tokens, and when it
# ends: summing a K/V store's rows each token cost ~2% of a small model's server
MEMORY_EVERY_TOKENS = 16


class Scheduler:
    def __init__(
        self,
        model: Model,
        ffn: FfnBackend,
        limits: SchedulerLimits,
        metrics: ServerMetrics,
        step_ahead: bool | None = None,
        prefix_cache: PrefixCache | None = None,
        steps: Steps | None = None,
    ) -> None:
        """`step_ahead`: batched greedy decode steps are queued before the step before them is
        read (`larql.inference.lookahead`); None: where the model is on CUDA (on the CPU the
        host does the computing, so there is nothing to overlap). `prefix_cache`: a prompt
        starts from the state of the longest prefix it shares with earlier prompts of its
        engine, and each prompt's state is offered to it once it is in. `steps`: what runs
        the model work of a turn (default: this process, `Steps`)."""
        self.model = model
        self.steps = steps or Steps()
        self.prefix_cache = (
            prefix_cache if prefix_cache is not None and prefix_cache.enabled else None
        )
        self.ffn = ffn
        self.limits = limits
        self.metrics = metrics
        self._cond = threading.Condition()
        self._active: deque[Session] = deque()
        self._queue: deque[Session] = deque()
        self._engines_seen: set[str] = set()
        self._fill_turn = True  # with prompts to fill and streams decoding: whose turn is next
        self._closing = False
        self._shutdown_at = float("inf")  # after it, running sessions end (shutdown)
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()  # the loop has ended
        self._rows_per_pass = rows_per_pass(model)
        self._step_ahead = model.device.type == "cuda" if step_ahead is None else step_ahead
        self._step_ahead = self._step_ahead and self.steps.may_go_ahead
        self.failure: RankFailed | None = None  # what stopped the loop, where something did
        self._ahead = Lookahead()
        self._ahead_sessions: dict[int, Session] = {}  # id(generation) → its session
        metrics.watch_engine_memory(self.memory_by_engine)
        if self.prefix_cache is not None:
            metrics.watch_prefix_cache(self.prefix_cache)

    # ------------------------------------------------------------------ called from the event loop

    def start(self) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="larql-scheduler")
                self._thread.daemon = True
                self._thread.start()

    def claim_this_thread(self) -> None:
        """The calling thread will `run` the loop: `start` then spawns none."""
        with self._cond:
            self._thread = threading.current_thread()

    def run(self) -> None:
        """The scheduling loop, on the calling thread, until shutdown ends it."""
        self._run()

    def begin_shutdown(self, grace_s: float | None = None) -> None:
        """Refuse new sessions; queued ones end at once, running ones after `grace_s` seconds
        (default: `shutdown_timeout_s`) unless they finish first, each with an error event,
        so open streams end cleanly. A later call may only shorten the grace. Safe in a
        signal handler on the scheduler's own thread: it only sets the deadline."""
        grace = self.limits.shutdown_timeout_s if grace_s is None else grace_s
        with self._cond:
            self._shutdown_at = min(self._shutdown_at, time.perf_counter() + max(grace, 0.0))
            self._closing = True
            self._cond.notify_all()

    def close(self, timeout_s: float = 10.0) -> None:
        """End every session now and wait (up to `timeout_s`) for the loop to stop."""
        self.begin_shutdown(0.0)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._stopped.wait(timeout_s)

    def submit(
        self, request: SessionRequest, engine: Engine, loop: asyncio.AbstractEventLoop
    ) -> Session:
        text = TextAssembler(self.model.tokenizer, request.stop_strings)
        stream = Session(request, engine, loop, text, self.limits.request_timeout_s)
        self.start()
        with self._cond:
            if self._closing:
                raise SchedulerClosed()
            if len(self._active) < self.limits.max_sessions and not self._queue:
                self._active.append(stream)
            elif len(self._queue) < self.limits.max_queue:
                self._queue.append(stream)
            else:
                raise QueueFull(self.limits.retry_after_s)
            self._engines_seen.add(request.engine_name)
            self.metrics.prompt_tokens.inc(len(request.prompt_ids))
            self._update_gauges()
            self._cond.notify_all()
        return stream

    def cancel(self, stream: Session) -> None:
        """The client is gone: a queued session leaves now, an active one before the next step."""
        with self._cond:
            if stream.ended:
                return
            stream.cancelled = True
            if stream in self._queue:
                self._queue.remove(stream)
                self._end(stream, "cancelled")
            self._cond.notify_all()

    def counts(self) -> tuple[int, int]:
        with self._cond:
            return len(self._active), len(self._queue)

    def memory_by_engine(self) -> dict[str, int]:
        with self._cond:
            held = dict.fromkeys(self._engines_seen, 0)
            for s in self._active:
                held[s.request.engine_name] += s.memory.total
            return held

    # ------------------------------------------------------------------ the scheduler thread

    def _run(self) -> None:
        try:
            self._loop()
        except RankFailed as e:  # the server's own failure: every session ends, then the loop
            log.debug("the server stops: %s", e)  # (the error itself reaches the caller)
            self.failure = e
            with _turn_events():
                self._shut_down(ErrorEvent(503, f"the server stopped: {e}", "server_error"))
            raise
        finally:
            self._stopped.set()
            self.steps.finish()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._admit()
                while not self._closing and not self._active:
                    if not self._cond.wait(self.steps.idle_s):
                        self.steps.idle()
                    self._admit()
                if self._closing and (not self._active or time.perf_counter() >= self._shutdown_at):
                    break
                try:
                    batch = self._pick()
                except RankFailed:
                    raise
                except Exception as e:  # a bug in picking: any active session may be touched
                    with _turn_events():
                        self._turn_failed(list(self._active), e)
                    continue
            with _turn_events():
                try:
                    self._turn(batch)
                except RankFailed:
                    raise
                except Exception as e:  # a bug outside every session's own guarded part
                    self._turn_failed(batch, e)
        with _turn_events():
            self._shut_down()

    def _turn_failed(self, sessions: list[Session], error: Exception) -> None:
        """The last guard: a turn failed outside the parts that end one session alone (a bug).
        The sessions it may have left half-stepped end with the error; the step queued ahead
        is dropped with its sessions; the queued and the other active sessions go on, so one
        bug never stops the server for everyone."""
        log.exception("a scheduler turn failed; its sessions end, the server goes on")
        failed = {id(s): s for s in [*sessions, *self._ahead_sessions.values()]}
        self._ahead, self._ahead_sessions = Lookahead(), {}
        self._fail_batch([s for s in failed.values() if not s.ended], error)

    def _turn(self, batch: list[Session]) -> None:
        """One step for the picked sessions: a step ahead where it goes ahead, else (after the
        step queued ahead is delivered) alone or together."""
        if self._goes_ahead(batch):
            self._advance_ahead(batch)
            return
        self._drain_ahead()
        batch = [s for s in batch if not s.ended]
        if len(batch) == 1:
            self._advance(batch[0])
        elif batch:
            self._advance_together(batch)

    def _pick(self) -> list[Session]:
        """The next step's sessions (lock held). With nothing decoding, new prompts take
        turns, a part of `SOLO_TURN_CHUNKS` × `prefill_chunk` tokens each (several short ones
        together, whole, where their engines batch and they fit `prefill_chunk` tokens).
        Otherwise the decoding session whose turn it is, with every one whose engine batches
        with its own; new prompts (or their next chunks) ride in that step, up to
        `prefill_chunk` tokens in all, so a prompt costs the running streams no step of their
        own. A prompt that cannot ride (another engine family, echo) takes turns with the
        decode steps instead, a chunk at a time, so a long prompt never stalls running
        streams for more than a chunk."""
        filling = [s for s in self._active if _prefilling(s)]
        decoding = [s for s in self._active if not _prefilling(s)]
        solo = SOLO_TURN_CHUNKS * self.limits.prefill_chunk
        if filling and not decoding:
            together = self._prompts_together(filling)
            if len(together) > 1 and together[0] is filling[0]:
                return together
            return [self._alone(filling[0], solo)]
        if filling and self._fill_turn:
            self._fill_turn = False
            alone = next((s for s in filling if not self._may_ride(s, decoding)), None)
            if alone is not None:
                return [self._alone(alone, self.limits.prefill_chunk)]
        self._fill_turn = True
        stream = self._alone(decoding[0], 0)
        others = len(decoding) > 1 or bool(filling)
        stream.step_rows = self.limits.prefill_chunk if others else solo
        key = stream.engine.batch_key() if stream.engine is not None else None
        if key is None or stream.cancelled or _mid_step(stream):
            return [stream]
        batch = [stream] + [
            s
            for s in decoding
            if s is not stream
            and not s.cancelled
            and s.generation is not None
            and not s.generation.finished
            and not _mid_step(s)
            and s.engine is not None
            and s.engine.batch_key() == key
        ]
        waiting = sum(_prompt_left(s) for s in filling)
        room = self._prompt_room(len(batch), waiting)
        for rider in filling:
            chunk = self._ride_chunk(rider, key, room)
            if chunk:
                rider.prefill_chunk = chunk
                batch.append(rider)
                room -= chunk
        return batch

    def _alone(self, stream: Session, prompt_tokens: int) -> Session:
        """`session` takes this turn (a prompt part of `prompt_tokens` tokens, or a step); the
        next turn of its kind goes to the one after it (lock held)."""
        stream.prefill_chunk = prompt_tokens
        self._active.remove(stream)
        self._active.append(stream)
        return stream

    def _prompt_room(self, decode_rows: int, waiting: int = 0) -> int:
        """The prompt tokens a step of `decode_rows` decode rows takes in: `prefill_chunk` at
        most, and where the products take rows in passes (`rows_per_pass`), what fills the
        step's last pass, or the next pass where less than a quarter of one is left: a row
        past a pass costs a whole pass, so a prompt goes in over two cheap steps rather than
        one that costs a pass more. Where `waiting` prompt tokens would fill further passes
        at least three quarters full, the step takes those passes too: a full pass costs its
        rows about what they cost in the first (on the default model 8 decode rows and 8
        prompt rows take 11.3 ms, and 24 prompt rows 20.4), and new streams then start in one
        step rather than several."""
        room, per_pass = self.limits.prefill_chunk, self._rows_per_pass
        if per_pass is None:
            return room
        left = -decode_rows % per_pass
        rows = left if left >= per_pass // 4 else left + per_pass
        while rows + per_pass <= room and waiting >= rows + 3 * per_pass // 4:
            rows += per_pass
        return min(room, rows)

    def _prompts_together(self, filling: list[Session]) -> list[Session]:
        """With nothing decoding: new prompts whose engines batch with the first one's, whole,
        as many as fit in `prefill_chunk` tokens (lock held)."""
        first = filling[0].engine
        key = first.joining_batch_key(self.model) if first is not None else None
        together, room = [], self.limits.prefill_chunk
        for stream in filling if key is not None else ():
            rest = _prompt_left(stream)
            if 0 < rest <= room and self._ride_chunk(stream, key, room) == rest:
                stream.prefill_chunk = rest
                together.append(stream)
                room -= rest
        return together

    def _may_ride(self, filling: Session, decoding: list[Session]) -> bool:
        """Whether a new prompt can ride in some decode step: some decoding session's engine
        batches with its prompt (lock held)."""
        if filling.engine is None:
            return False
        key = filling.engine.joining_batch_key(self.model)
        if not any(s.engine is not None and s.engine.batch_key() == key for s in decoding):
            return False
        return self._ride_chunk(filling, key, self.limits.prefill_chunk) > 0

    def _ride_chunk(self, filling: Session, key: object, room: int) -> int:
        """The prompt tokens `filling` takes in a step of the engines of batch `key` that takes
        `room` more prompt tokens; 0: it does not ride (lock held)."""
        request, engine = filling.request, filling.engine
        if room < 1 or filling.cancelled or engine is None or request.max_new_tokens == 0:
            return 0
        if request.echo or engine.joining_batch_key(self.model) != key:
            return 0
        try:
            generation = self._generation(filling)
        except RankFailed:
            raise
        except Exception:  # (its own turn, alone, reports it and ends it)
            return 0
        chunk = min(len(generation.prompt_ids) - generation.prompt_done, room)
        return chunk if generation.takes_prompt_in_batch(chunk) else 0

    def _advance_together(self, batch: list[Session]) -> None:
        """One step for sessions whose engines batch: a decode row each, and new prompts'
        chunks riding in it (`prefill_chunk` tokens each). Sessions that cannot take it leave
        first (`_ready`); one whose own part fails ends alone (`SessionsFailed`); where a
        shared part fails and the engines rolled the step back, each takes it alone; any
        other failure of the shared step ends every session in it."""
        batch = self._fitting(self._ready(batch))
        if len(batch) < 2:
            for stream in batch:
                self._advance(stream)
            return
        generations = [self._generation(s) for s in batch]
        riding = [not g.started for g in generations]
        failures: dict[int, Exception] = {}
        try:
            if any(riding):
                chunks = [s.prefill_chunk for s in batch]
                tokens: list[int | None] = self.steps.advance_together(generations, chunks)
            else:
                tokens = list(self.steps.step_together(generations))
        except RankFailed:
            raise
        except SessionsFailed as e:
            tokens, failures = e.tokens, e.failures
        except StepRolledBack as e:
            if isinstance(e.__cause__, RankFailed):
                raise e.__cause__ from None
            log.exception("a batched step failed; its sessions step alone")
            for stream in batch:
                self._advance(stream)
            return
        except Exception as e:
            log.exception("batched step failed")
            self._fail_batch(batch, e)
            return
        now = time.perf_counter()
        for i, (stream, token, rode) in enumerate(zip(batch, tokens, riding, strict=True)):
            if i in failures:
                self._fail(stream, failures[i])
                continue
            if token is None:  # a chunk of its prompt went in
                self._offer_part_to_cache(stream)
                continue
            if rode:
                self.metrics.time_to_first_token.observe(now - stream.arrived)
            else:
                self.metrics.time_per_output_token.observe(now - stream.last_token_at)
            stream.last_token_at = now
            self._deliver(stream, token)

    def _fitting(self, batch: list[Session]) -> list[Session]:
        """The sessions of `batch` that can still take this shared step as it was picked:
        the same batch key as the first, and a new prompt's chunk that may still go into a
        batched step. One that cannot (its state moved since it was picked) is left for a
        turn of its own instead of failing the step for all (lock not held)."""
        first = batch[0].engine if batch else None
        key = first.joining_batch_key(self.model) if first is not None else None
        fitting = []
        for stream in batch:
            generation = self._generation(stream)
            engine = stream.engine
            same = engine is not None and engine.joining_batch_key(self.model) == key
            rides = generation.started or generation.takes_prompt_in_batch(stream.prefill_chunk)
            if same and rides:
                fitting.append(stream)
            else:
                log.warning(
                    "a session left a shared step before it ran: %s (same key %s, takes its "
                    "prompt chunk of %d: %s)",
                    stream.request.engine_spec,
                    same,
                    stream.prefill_chunk,
                    rides,
                )
        return fitting

    def _ready(self, batch: list[Session]) -> list[Session]:
        """The sessions of `batch` that can take a shared step; each other one ends now, alone:
        cancelled, timed out, or in a state its tokens do not explain (lock not held)."""
        now = time.perf_counter()
        in_flight = {id(g) for g in self._ahead.in_flight}
        ready = []
        for stream in batch:
            if stream.ended:
                continue
            if stream.cancelled:
                self._retire(stream, "cancelled")
                continue
            if now >= stream.deadline:
                stream.emit(self._timeout_event())
                self._retire(stream, "timeout")
                continue
            generation = stream.generation
            queued = int(generation is not None and id(generation) in in_flight)
            fault = generation.state_fault(queued) if generation is not None else None
            if fault is not None:
                log.error("a session left a batched step: %s", fault)
                message = f"internal error in this stream: {fault}"
                stream.emit(ErrorEvent(500, message, "server_error"))
                self._retire(stream, "error")
                continue
            ready.append(stream)
        return ready

    def _goes_ahead(self, batch: list[Session]) -> bool:
        """Whether this turn's step is queued a step ahead: step-ahead is on, and the batch
        is two or more decoding greedy sessions that `goes_ahead` (no prompt riding)."""
        if not self._step_ahead or len(batch) < 2:
            return False
        if any(s.cancelled or s.generation is None or not s.generation.started for s in batch):
            return False
        return goes_ahead([s.generation for s in batch if s.generation is not None])

    def _advance_ahead(self, batch: list[Session]) -> None:
        """Queue this batch's step, then deliver the tokens of the step queued before (which
        may hold other sessions too). Where the new step fails to launch and its engines
        rolled it back, the step queued before is delivered and each session steps alone;
        any other failure ends every session in either step."""
        batch = self._ready(batch)
        generations = [s.generation for s in batch if s.generation is not None]
        if not generations:
            return
        self._ahead_sessions.update((id(g), s) for g, s in zip(generations, batch, strict=True))
        try:
            read = self._ahead.advance(generations)
        except StepRolledBack:
            log.exception("a step queued ahead failed to launch; its sessions step alone")
            self._drain_ahead()
            for stream in batch:
                if not stream.ended:
                    self._advance(stream)
            return
        except Exception as e:
            self._ahead_failed(batch, e)
            return
        self._deliver_read(read)

    def _drain_ahead(self) -> None:
        """Deliver the step queued ahead, if any, before the sessions step any other way."""
        if not self._ahead.in_flight:
            return
        try:
            read = self._ahead.drain()
        except Exception as e:
            self._ahead_failed([], e)
            return
        self._deliver_read(read)

    def _ahead_failed(self, batch: list[Session], error: Exception) -> None:
        """A step queued ahead failed (on the device, or to launch without rolling back): it
        ends every session in `batch` and every one with a step queued, and the next step
        starts afresh."""
        log.exception("batched step failed")
        failed = {id(s): s for s in [*batch, *self._ahead_sessions.values()]}
        self._ahead, self._ahead_sessions = Lookahead(), {}
        self._fail_batch(list(failed.values()), error)

    def _deliver_read(self, read: list[tuple[GenerationSession, int]]) -> None:
        """Deliver the tokens a step-ahead read gave; a session the delivery ends (a stop
        string) has its next queued step taken back."""
        sessions = self._ahead_sessions
        now = time.perf_counter()
        for generation, token in read:
            stream = sessions.get(id(generation))
            if stream is None or stream.ended or stream.generation is not generation:
                continue  # ended while its step was queued (cancelled, timed out)
            self.metrics.time_per_output_token.observe(now - stream.last_token_at)
            stream.last_token_at = now
            self._deliver(stream, token)
            if generation.finished:
                self._ahead.withdraw(generation)
        self._ahead_sessions = {id(g): sessions[id(g)] for g in self._ahead.in_flight}

    def _fail_batch(self, batch: list[Session], error: Exception) -> None:
        """A shared step failed: every session in it ends with the error."""
        for stream in batch:
            self._fail(stream, error)

    def _fail(self, stream: Session, error: Exception) -> None:
        """`session` ends with `error` (a typed one as itself, anything else as a 500)."""
        if stream.ended:
            return
        if isinstance(error, LarqlError):
            stream.emit(error_event(error))
        else:
            message = f"internal error in this stream: {type(error).__name__}: {error}"
            stream.emit(ErrorEvent(500, message, "server_error"))
        self._retire(stream, "error")

    def _admit(self) -> None:
        """Between two steps: free cancelled sessions, drop timed-out queued ones (every queued
        one once shutdown began), then fill free decode slots in arrival order (lock held)."""
        for stream in [s for s in self._active if s.cancelled]:
            self._active.remove(stream)
            self._end(stream, "cancelled")
        now = time.perf_counter()
        for stream in [s for s in self._queue if now >= s.deadline or self._closing]:
            self._queue.remove(stream)
            if self._closing:
                stream.emit(_SHUTTING_DOWN)
                self._end(stream, "shutdown")
            else:
                stream.emit(self._timeout_event())
                self._end(stream, "timeout")
        while self._queue and len(self._active) < self.limits.max_sessions:
            self._active.append(self._queue.popleft())
        self._update_gauges()

    def _advance(self, stream: Session) -> None:
        """One turn of `session` alone: a part of its prompt, or a decode step (or a part of
        one)."""
        if stream.ended:
            return
        if stream.cancelled:
            self._retire(stream, "cancelled")
            return
        if time.perf_counter() >= stream.deadline:
            stream.emit(self._timeout_event())
            self._retire(stream, "timeout")
            return
        try:
            token = self._next_token(stream)
        except RankFailed:
            raise
        except LarqlError as e:
            stream.emit(error_event(e))
            self._retire(stream, "error")
            return
        except Exception as e:  # a bug: end this stream only, keep serving the others
            log.exception("session failed")
            message = f"internal error in this stream: {type(e).__name__}: {e}"
            stream.emit(ErrorEvent(500, message, "server_error"))
            self._retire(stream, "error")
            return
        if token is not None:
            self._deliver(stream, token)

    def _next_token(self, stream: Session) -> int | None:
        """The session's next token: its first once its prompt is all in, or a decode step's;
        None when only a part of its prompt (or of a step) went in, or the session only scores
        its prompt (it ends here once that is done)."""
        generation = self._generation(stream)
        request = stream.request
        if generation.started:
            token = self.steps.step_part(generation, stream.step_rows)
            if token is None:
                return None
            now = time.perf_counter()
            self.metrics.time_per_output_token.observe(now - stream.last_token_at)
            stream.last_token_at = now
            return token
        if request.max_new_tokens == 0:
            done = self.steps.feed_prompt(generation, stream.prefill_chunk)
            self._score(stream)
            if done:
                self._scored(stream)
            return None
        token = self.steps.prefill_part(generation, stream.prefill_chunk)
        self._score(stream)
        if token is None:
            self._offer_part_to_cache(stream)
            return None
        if request.echo:
            scored = tuple(stream.scorer.records) if stream.scorer is not None else ()
            stream.emit(PromptEvent(scored))
        now = time.perf_counter()
        self.metrics.time_to_first_token.observe(now - stream.arrived)
        stream.last_token_at = now
        return token

    def _score(self, stream: Session) -> None:
        """Score the prompt rows the last part returned (echo with logprobs)."""
        generation = stream.generation
        if stream.scorer is None or generation is None or generation.prompt_rows is None:
            return
        start = generation.prompt_rows_start
        rows, generation.prompt_rows = generation.prompt_rows, None
        with torch.inference_mode():
            stream.scorer.add(rows, start, generation.prompt_done - start)

    def _scored(self, stream: Session) -> None:
        """Echo with nothing to generate: the prompt is in (and scored): the session is done."""
        assert stream.engine is not None
        scored = tuple(stream.scorer.records) if stream.scorer is not None else ()
        stream.memory = stream.engine.memory()
        self._note_what_ran(stream)
        stream.emit(PromptEvent(scored))
        stream.emit(DoneEvent("length", len(stream.request.prompt_ids), (), stream.memory))
        self.metrics.e2e_latency.observe(time.perf_counter() - stream.arrived)
        self._retire(stream, "finished")

    def _generation(self, stream: Session) -> GenerationSession:
        """The session's generation, made at its first turn."""
        if stream.generation is None:
            assert stream.engine is not None
            request = stream.request
            prompt, resumed = request.prompt_ids, self._cached_start(request)
            if resumed is not None:
                stream.engine, prompt = resumed.engine, prompt[resumed.tokens :]
            opening = Opening(
                request.engine_spec,
                tuple(prompt),
                request.max_new_tokens,
                request.sampling,
                stop_ids=frozenset() if request.ignore_eos else None,
                keep_prompt_rows=request.scores_prompt,
                resumes=resumed is not None,
            )
            stream.generation = self.steps.open(opening, stream.engine, self.model, self.ffn)
            if request.logprobs is not None and request.scores_prompt:
                stream.scorer = PromptScorer(self.model, request.prompt_ids, request.logprobs)
            log.debug(
                "session starts: %s, %d prompt tokens (%d from the prefix cache), up to %d "
                "new, after %.1f ms waiting",
                request.engine_spec,
                len(request.prompt_ids),
                resumed.tokens if resumed is not None else 0,
                request.max_new_tokens,
                1000 * (time.perf_counter() - stream.arrived),
            )
        return stream.generation

    def _cached_start(self, request: SessionRequest) -> CachedStart | None:
        """A copy of the cached state its prompt starts from, if any (a prompt whose rows
        are scored needs them all, so it starts afresh)."""
        if self.prefix_cache is None or request.scores_prompt or request.max_new_tokens == 0:
            return None
        return self.prefix_cache.lookup(self.model, request.engine_spec, request.prompt_ids)

    def _offer_to_cache(self, stream: Session) -> None:
        """The state after its prompt, kept for later prompts that start the same way."""
        if self.prefix_cache is None or stream.engine is None:
            return
        request, generation = stream.request, stream.generation
        from_cache = generation.held if generation is not None else 0
        try:
            self.prefix_cache.store(
                self.model, request.engine_spec, request.prompt_ids, stream.engine, from_cache
            )
        except Exception:  # the cache is a saving, never a reason for a stream to fail
            log.exception("a prompt's state could not be cached")

    def _offer_part_to_cache(self, stream: Session) -> None:
        """A fresh prompt part-way in: what its parts so far keep, kept for later prompts that
        share them (`PrefixCache.store_part_way`; engines that cut a longer prompt's state back
        make no such copy), at most once per `PART_STATES_EVERY` tokens."""
        engine, generation = stream.engine, stream.generation
        if self.prefix_cache is None or engine is None or generation is None or generation.held:
            return
        done = engine.position
        if not engine.leaves_part_way_states or not engine.prompt_part_way():
            return
        if done - stream.part_cached < PART_STATES_EVERY:
            return
        stream.part_cached = done
        try:
            self.prefix_cache.store_part_way(
                self.model, stream.request.engine_spec, stream.request.prompt_ids[:done], engine
            )
        except Exception:  # the cache is a saving, never a reason for a stream to fail
            log.exception("a prompt's part-way state could not be cached")

    def _deliver(self, stream: Session, token: int) -> None:
        generation = stream.generation
        assert generation is not None and stream.engine is not None
        if len(generation.tokens) == 1:  # its prompt is in: the engine holds the prompt's state
            self._offer_to_cache(stream)
        if generation.finished or len(generation.tokens) % MEMORY_EVERY_TOKENS == 0:
            stream.memory = stream.engine.memory()
        self.metrics.completion_tokens.inc()
        text, top_n = stream.text, stream.request.logprobs
        start = text.decoded
        piece = text.feed(token)
        if top_n is not None:
            assert generation.logits is not None
            record = token_logprob(generation.logits, token, top_n)
            stream.track.add(token, record, start, text.decoded)
        if text.hit_stop_string:
            generation.stop()
        if piece:
            stream.emit(TokenEvent(piece, stream.track.ready(len(text.text))))
        if not generation.finished:
            return
        tail = text.flush()
        if tail:
            stream.emit(TokenEvent(tail, stream.track.ready(len(text.text))))
        self._note_what_ran(stream)  # before its end reaches the request (and its log line)
        done = DoneEvent(
            generation.finish_reason,
            len(stream.request.prompt_ids),
            tuple(generation.tokens),
            stream.memory,
            stream.track.ready(len(text.text), final=True),
        )
        stream.emit(done)
        self.metrics.e2e_latency.observe(time.perf_counter() - stream.arrived)
        self._retire(stream, "finished")

    def _retire(self, stream: Session, outcome: str) -> None:
        with self._cond:
            if stream in self._active:
                self._active.remove(stream)
            self._end(stream, outcome)

    def _note_what_ran(self, stream: Session) -> None:
        generation = stream.generation
        if generation is None or stream.decode_path is not None:
            return
        stream.cached_tokens = generation.held
        stream.generated = len(generation.tokens)
        stream.decode_path = decode_path(
            self.model, generation.decode_kinds, len(generation.step_ms)
        )
        log.debug(
            "session ends: %s, %d generated, decode path: %s",
            stream.request.engine_spec,
            stream.generated,
            stream.decode_path,
        )

    def _end(self, stream: Session, outcome: str) -> None:
        """Free the session's engine state and count how it ended (lock held)."""
        if stream.ended:
            return
        self._note_what_ran(stream)
        stream.ended = True
        if stream.generation is not None:
            self.steps.close(stream.generation)
        stream.generation = None
        stream.engine = None
        stream.memory = MemoryBreakdown()
        self.metrics.sessions.labels(outcome).inc()
        self._update_gauges()

    def _shut_down(self, event: ErrorEvent | None = None) -> None:
        with self._cond:
            for stream in [*self._active, *self._queue]:
                stream.emit(event or _SHUTTING_DOWN)
                self._end(stream, "shutdown")
            self._active.clear()
            self._queue.clear()
            self._update_gauges()
        self._ahead, self._ahead_sessions = Lookahead(), {}

    def _timeout_event(self) -> ErrorEvent:
        seconds = f"{self.limits.request_timeout_s:g}"
        return ErrorEvent(
            408, f"the request timed out after {seconds} s (--request-timeout)", "timeout_error"
        )

    def _update_gauges(self) -> None:
        self.metrics.active_sessions.set(len(self._active))
        self.metrics.queued_sessions.set(len(self._queue))


_SHUTTING_DOWN = ErrorEvent(503, "the server is shutting down", "server_error")


def _prompt_left(stream: Session) -> int:
    """Its prompt tokens not yet in the engine (after a cached start: of the rest)."""
    generation = stream.generation
    if generation is None:
        return len(stream.request.prompt_ids)
    return len(generation.prompt_ids) - generation.prompt_done


def _prefilling(stream: Session) -> bool:
    """Its prompt is not all in the engine yet (not started, or part-way through a chunked
    prefill)."""
    return stream.generation is None or not stream.generation.started


def _mid_step(stream: Session) -> bool:
    """It is part-way through a decode step taken in parts."""
    return stream.generation is not None and stream.generation.mid_step
