"""The model work of the scheduler's turns, in one object: a session's generation is made here,
and every call that runs the model on it (a part of its prompt, a decode step, a batched step
of several sessions) goes through here. The scheduler decides; `Steps` executes. In one process
it calls the generation's own methods; under tensor parallelism (`larql.server.tensor_parallel`)
rank 0's `Steps` first tells the other ranks what it is about to run, so that each runs the same
call on its share of the model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from larql.inference.engine import Engine
from larql.inference.ffn import FfnBackend
from larql.inference.generation import GenerationSession, advance_together, step_together
from larql.inference.sampling import Sampler, SamplingParams
from larql.models.model import Model


@dataclass(frozen=True)
class Opening:
    """What a session's generation is made from, besides its engine: plain values, so that
    another rank can make the same generation over an engine built from `engine_spec`."""

    engine_spec: str
    prompt_ids: tuple[int, ...]  # what goes into the engine (after a cached start: the rest)
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int] | None  # None: the tokenizer's
    keep_prompt_rows: bool
    resumes: bool  # the engine holds a cached prefix's state already


class Steps:
    """Runs the model work the scheduler hands it, here."""

    # how long the scheduler may wait for work before `idle` (None: as long as it likes)
    idle_s: float | None = None
    # whether batched greedy steps may be queued a step ahead (`larql.inference.lookahead`)
    may_go_ahead = True

    def open(
        self, opening: Opening, engine: Engine, model: Model, ffn: FfnBackend
    ) -> GenerationSession:
        """A session's generation over `engine`."""
        return GenerationSession(
            engine,
            model,
            ffn,
            opening.prompt_ids,
            opening.max_new_tokens,
            Sampler(opening.sampling),
            stop_ids=opening.stop_ids,
            keep_prompt_rows=opening.keep_prompt_rows,
            resumes=opening.resumes,
        )

    def close(self, generation: GenerationSession) -> None:
        """The session ended: its generation takes no more work."""

    def prefill_part(self, generation: GenerationSession, max_tokens: int) -> int | None:
        return generation.prefill_part(max_tokens)

    def feed_prompt(self, generation: GenerationSession, max_tokens: int) -> bool:
        """`feed_prompt` → whether the whole prompt is in."""
        return generation.feed_prompt(max_tokens) is not None

    def step_part(self, generation: GenerationSession, max_rows: int) -> int | None:
        return generation.step_part(max_rows)

    def step_together(self, generations: Sequence[GenerationSession]) -> list[int]:
        return step_together(generations)

    def advance_together(
        self, generations: Sequence[GenerationSession], chunks: Sequence[int]
    ) -> list[int | None]:
        return advance_together(generations, chunks)

    def idle(self) -> None:
        """The scheduler waited `idle_s` with nothing to run."""

    def finish(self) -> None:
        """The scheduler has stopped: no more work will come."""
