"""The one generation loop every command uses: prefill, pick, then decode step by step through
an engine. `GenerationSession` is that loop in a form the caller steps (the server interleaves
many sessions token by token); `generate` runs one session to the end, streaming each token to a
callback."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from larql.inference.batching import RowsFailed, advance_batch, decode_batch
from larql.inference.engine import Engine
from larql.inference.errors import EmptyPrompt, InvariantViolation
from larql.inference.ffn import FfnBackend
from larql.inference.fused import takes_fused
from larql.inference.layer import final_logits
from larql.inference.linear import kernel_rows
from larql.inference.norm import rms_norm
from larql.inference.sampling import Sampler, greedy_picks
from larql.kernels.cpu import cpu_extension
from larql.kernels.ran import recording
from larql.models.blocks import ACTIVATION_BITS
from larql.models.model import Model
from larql.parallel.sampling import AgreedSampler

FinishReason = Literal["stop", "length"]
# New tokens a session tells its engine to expect room for at once (`Engine.expect_tokens`): a
# short generation's state is allocated once instead of growing every few steps (on the default
# model, growing eight sessions' 30 layers of K/V cost ~0.3 ms a batched step on average); a
# long one's grows from there as before.
EXPECTED_AHEAD = 512
# on_token(token_id) may return True to stop early (a client went away, a stop string matched).
TokenCallback = Callable[[int], bool | None]


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: FinishReason
    prefill_ms: float  # prefill + first pick
    step_ms: list[float] = field(default_factory=list)  # each later token: forward + pick
    # the kernel paths the decode steps took (`larql.kernels.ran`; empty: eager torch)
    decode_kinds: frozenset[str] = frozenset()

    @property
    def decode_tok_s(self) -> float | None:
        total = sum(self.step_ms)
        return 1000.0 * len(self.step_ms) / total if total > 0 else None


def next_token_logits(model: Model, hidden: torch.Tensor) -> torch.Tensor:
    """An engine's output hidden [1, H] → next-token logits [V]."""
    return final_logits(model, hidden)[0]


def rows_logits(model: Model, hidden: torch.Tensor) -> torch.Tensor:
    """Hidden rows [B, H] of B sessions' decode steps → logits [B, V], each row as
    `next_token_logits` computes it alone (on the CPU an LM head held in blocks is read once
    for all rows by the compiled product, with the one-row call's arithmetic)."""
    blocks = model.weights.lm_head_blocks
    kernels = cpu_extension() if blocks is not None and takes_fused(hidden[:1]) else None
    if blocks is None or kernels is None or model.config.arch.final_softcap is not None:
        return final_logits(model, hidden)
    x = rms_norm(hidden, model.weights.final_norm, model.config.norm_eps).contiguous()
    data, code = kernel_rows(blocks, kernels)
    return kernels.block_gemm(x, data, code, ACTIVATION_BITS[blocks.activation])  # [B, V]


class SessionsFailed(Exception):
    """A batched step in which some sessions' own parts failed (`batching.RowsFailed`): the
    others took their step. `tokens`: each session's token as the step's function returns
    them, None for a failed session; `failures`: the index of each failed session → what its
    part raised (its engine's state is then undefined: drop the session)."""

    def __init__(self, tokens: list[int | None], failures: dict[int, Exception]) -> None:
        first = next(iter(failures.values()))
        super().__init__(f"{len(failures)} of a batched step's sessions failed: {first}")
        self.tokens = tokens
        self.failures = failures


def step_together(sessions: Sequence[GenerationSession]) -> list[int]:
    """One decode step for sessions of one model whose engines batch together
    (`decode_batch`): each session's last token in, each session's next token out, as
    `step()` would give it alone. `SessionsFailed` where some sessions' own parts failed."""
    for gen in sessions:
        gen.check_can_step()
    model, ffn = sessions[0].model, sessions[0].ffn
    failures: dict[int, Exception] = {}
    with torch.inference_mode():
        t0 = time.perf_counter()
        engines = [s.engine for s in sessions]
        kinds: set[str] = set()
        try:
            with recording(kinds):  # what the shared step ran is what each session's ran
                hidden = decode_batch(engines, model, ffn, [s.tokens[-1] for s in sessions])
        except RowsFailed as e:
            hidden, failures = e.hidden, e.failures
        for gen in sessions:
            gen.decode_kinds |= kinds
        ok = [i for i in range(len(sessions)) if i not in failures]
        if not ok:
            raise SessionsFailed([None] * len(sessions), failures)
        if failures:
            hidden = hidden[ok]
        logits = rows_logits(model, hidden)  # [B', V]
        picked = _picks([sessions[i] for i in ok], logits)
        elapsed = (time.perf_counter() - t0) * 1000
    tokens: list[int | None] = [None] * len(sessions)
    for i, row, token in zip(ok, logits, picked, strict=True):
        gen = sessions[i]
        gen.logits = row
        gen.step_ms.append(elapsed)
        gen._accept(token)
        tokens[i] = token
    if failures:
        raise SessionsFailed(tokens, failures)
    return picked


def _picks(sessions: Sequence[GenerationSession], logits: torch.Tensor) -> list[int]:
    """Each session's pick from its row of logits [B, V] (greedy ones: one argmax for all)."""
    if all(s.sampler.params.greedy for s in sessions):
        return greedy_picks(logits)
    return [s.sampler.pick(row) for s, row in zip(sessions, logits, strict=True)]


def advance_together(
    sessions: Sequence[GenerationSession], prompt_tokens: Sequence[int]
) -> list[int | None]:
    """`step_together` where some sessions are still taking their prompt: session i, if
    started, takes a decode step; otherwise its next prompt_tokens[i] prompt tokens go in (at
    most: the rest of its prompt; `takes_prompt_in_batch` says whether it may). → each
    session's next token, None for one whose prompt is not all in yet. Each session's tokens
    are those it would get alone, up to the order of float sums (exactly, on the CPU's
    compiled layer, for a prompt that fits one compiled call). `SessionsFailed` where some
    sessions' own parts failed."""
    token_lists: list[list[int]] = []
    for gen, chunk in zip(sessions, prompt_tokens, strict=True):
        if gen.started:
            gen.check_can_step()
            token_lists.append([gen.tokens[-1]])
        else:
            token_lists.append(gen._prompt_chunk(chunk))
    model, ffn = sessions[0].model, sessions[0].ffn
    failures: dict[int, Exception] = {}
    with torch.inference_mode():
        t0 = time.perf_counter()
        kinds: set[str] = set()
        try:
            with recording(kinds):
                hidden = advance_batch([s.engine for s in sessions], model, ffn, token_lists)
        except RowsFailed as e:
            hidden, failures = e.hidden, e.failures
        for gen in sessions:
            if gen.started:  # a decode row of the step (a prompt's chunk is no decode step)
                gen.decode_kinds |= kinds
        for i, (gen, tokens) in enumerate(zip(sessions, token_lists, strict=True)):
            if not gen.started and i not in failures:
                gen.prompt_done += len(tokens)
        picking = [
            i
            for i, s in enumerate(sessions)
            if i not in failures and (s.started or s.prompt_done == len(s.prompt_ids))
        ]
        picked: list[int] = []
        rows: list[torch.Tensor] = []
        if picking:
            logits = rows_logits(model, torch.cat([hidden[i][-1:] for i in picking]))  # [P, V]
            picked, rows = _picks([sessions[i] for i in picking], logits), list(logits)
        elapsed = (time.perf_counter() - t0) * 1000
    tokens: list[int | None] = [None] * len(sessions)
    for i, row, token in zip(picking, rows, picked, strict=True):
        gen = sessions[i]
        gen.logits = row
        if gen.started:
            gen.step_ms.append(elapsed)
        else:
            gen.last_hidden = hidden[i][-1:]
            gen.prefill_ms += elapsed
        gen._accept(token)
        tokens[i] = token
    for gen, token in zip(sessions, tokens, strict=True):
        if token is None:
            gen.prefill_ms += elapsed
    if failures:
        raise SessionsFailed(tokens, failures)
    return tokens


class GenerationSession:
    """One generation that the caller steps: `prefill()` gives the first token, each `step()`
    the next, until `finished`. `generate` drives it in a loop; the server interleaves many.

    The engine's state lives as long as the session; drop the session to free it."""

    def __init__(
        self,
        engine: Engine,
        model: Model,
        ffn: FfnBackend,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampler: Sampler | None = None,
        stop_ids: frozenset[int] | None = None,
        max_positions: int | None = None,
        keep_prompt_rows: bool = False,
        resume_hidden: torch.Tensor | None = None,
        resumes: bool = False,
    ) -> None:
        """`resumes`: the engine holds a state already (a restored snapshot, a prefix cache's
        copy) that `prompt_ids` continue — in one pass per part where the engine extends a
        prefill exactly, else as decode steps. `resume_hidden` [1, H]: that state's last
        output row, which lets `prompt_ids` be empty (implies `resumes`)."""
        self.resumes = resumes or resume_hidden is not None
        if not prompt_ids and resume_hidden is None:
            raise EmptyPrompt()
        self.engine = engine
        self.model = model
        self.ffn = ffn
        self.prompt_ids = list(prompt_ids)
        self.sampler = sampler or Sampler()
        if model.shard is not None:  # a tensor-parallel rank feeds rank 0's picks
            self.sampler = AgreedSampler(self.sampler, model.shard)
        self.stop_ids = model.tokenizer.stop_ids if stop_ids is None else stop_ids
        limit = model.config.max_positions if max_positions is None else max_positions
        # `max_positions` caps prompt + generated tokens
        held = engine.position if self.resumes else 0
        self.held = held  # positions the engine held before the session's first token
        self.budget = min(max_new_tokens, max(limit - held - len(self.prompt_ids), 0))
        engine.expect_tokens(held + len(self.prompt_ids) + min(self.budget, EXPECTED_AHEAD))
        self.resume_hidden = resume_hidden
        self.last_hidden: torch.Tensor | None = None  # the prompt's last output row [1, H]
        self.tokens: list[int] = []
        self.finish_reason: FinishReason = "length"
        self.finished = self.budget <= 0
        self.prefill_ms = 0.0
        self.step_ms: list[float] = []
        self.decode_kinds: set[str] = set()  # what `step` ran (`larql.kernels.ran`)
        self.keep_prompt_rows = keep_prompt_rows
        # the hidden rows the engine returned for the prompt's tokens that went in last, ending
        # with the last of them [S', H] (kept only with `keep_prompt_rows`: scoring the prompt
        # needs them)
        self.prompt_rows: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None  # [V] the raw logits of the last pick
        self.prompt_done = 0  # prompt tokens in the engine so far (a chunked prefill)
        self.prompt_rows_start = 0  # the prompt position of `prompt_rows`' first row
        self._step_parts: Iterator[torch.Tensor | None] | None = None  # a step in parts
        self._finishing = False  # the prompt is in; its engine's policy is not done with it
        self._parts_ms = 0.0  # the time of its parts so far

    @property
    def started(self) -> bool:
        return bool(self.tokens)

    def prefill(self) -> int:
        """Run the prompt through the engine → the first generated token."""
        if self.started or self.finished:
            raise InvariantViolation("prefill called twice or after the session finished")
        with torch.inference_mode():
            t0 = time.perf_counter()
            if self.resumes:
                hidden = self._continue(self.prompt_ids, self.resume_hidden, more=False)
                self.engine.finish_prompt(sys.maxsize)  # (a prompt it took part-way: its end)
            elif self.keep_prompt_rows:
                self.prompt_rows = self.engine.prefill_all(self.model, self.ffn, self.prompt_ids)
                hidden = self.prompt_rows[-1:]
            else:
                hidden = self.engine.prefill(self.model, self.ffn, self.prompt_ids)
            self.last_hidden = hidden
            self.prompt_done = len(self.prompt_ids)
            self.logits = next_token_logits(self.model, hidden)
            token = self.sampler.pick(self.logits)
            self.prefill_ms = (time.perf_counter() - t0) * 1000
        self._accept(token)
        return token

    def check_can_step(self) -> None:
        if not self.started:
            raise InvariantViolation("step called before prefill")
        if self.finished:
            raise InvariantViolation("step called after the session finished")

    def state_fault(self, queued: int = 0) -> str | None:
        """Why the session cannot take its next step or prompt part now (None: it can): it
        has finished, or its engine's position is not the one its tokens say (`queued`:
        steps launched and not yet accepted, `larql.inference.lookahead`). A cheap check
        before a step it shares with other sessions."""
        if self.finished:
            return "its generation has finished"
        fed = self.held + self.prompt_done + max(len(self.tokens) - 1, 0) + queued
        if self.engine.position != fed:
            return f"its engine is at position {self.engine.position}, its tokens at {fed}"
        return None

    def prefill_part(self, max_tokens: int) -> int | None:
        """Prefill at most `max_tokens` more prompt tokens (`feed_prompt`) → the first
        generated token once the whole prompt is in, else None."""
        if self.started or self.finished:
            raise InvariantViolation("prefill called twice or after the session finished")
        hidden = self.feed_prompt(max_tokens)
        if hidden is None:
            return None
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.logits = next_token_logits(self.model, hidden)
            token = self.sampler.pick(self.logits)
            self.prefill_ms += (time.perf_counter() - t0) * 1000
        self._accept(token)
        return token

    def feed_prompt(self, max_tokens: int) -> torch.Tensor | None:
        """Put at most `max_tokens` more prompt tokens into the engine → the prompt's last
        hidden row [1, H] once it is all in, else None. In parts where the engine takes a
        prompt in parts (`Engine.takes_prompt_in_parts`) or a restored state is resumed (its
        prompt goes in as decode steps); otherwise the whole prompt at once. With
        `keep_prompt_rows`, `prompt_rows` then holds the rows of the tokens that went in
        (from prompt position `prompt_rows_start`). Once the last part is in, later calls do
        the work the engine's policy left for then, a part of about `max_tokens` rows each
        (`Engine.finish_prompt`), before the last row is given (a session with no token to
        generate skips it). Nothing is picked: a session with nothing to generate
        (`max_new_tokens` 0) takes its prompt this way."""
        if self._finishing:
            with torch.inference_mode():
                t0 = time.perf_counter()
                self._finishing = not self.engine.finish_prompt(max(max_tokens, 1))
                self.prefill_ms += (time.perf_counter() - t0) * 1000
            return None if self._finishing else self.last_hidden
        if self.started or self.prompt_done == len(self.prompt_ids) > 0:
            raise InvariantViolation("the prompt is in already")
        start, rest = self.prompt_done, len(self.prompt_ids) - self.prompt_done
        resumed = self.resumes
        in_parts = resumed or self.engine.takes_prompt_in_parts(self.model)
        count = min(rest, max(max_tokens, 1)) if in_parts else rest
        chunk = self.prompt_ids[start : start + count]
        more = start + count < len(self.prompt_ids)
        rows: torch.Tensor | None = None
        with torch.inference_mode():
            t0 = time.perf_counter()
            if resumed:
                hidden = self._continue(
                    chunk, self.resume_hidden if start == 0 else self.last_hidden, more
                )
            elif in_parts:
                rows = self.engine.prefill_part(self.model, self.ffn, chunk, more)
                hidden = rows[-1:]
            elif self.keep_prompt_rows:
                rows = self.engine.prefill_all(self.model, self.ffn, chunk)
                hidden = rows[-1:]
            else:
                hidden = self.engine.prefill(self.model, self.ffn, chunk)
            self.prefill_ms += (time.perf_counter() - t0) * 1000
        self.prompt_done += count
        self.last_hidden = hidden
        if self.keep_prompt_rows:
            self.prompt_rows, self.prompt_rows_start = rows, start
        if more:
            return None
        self._finishing = self.budget > 0 and not self.engine.finish_prompt(0)
        return None if self._finishing else hidden

    def _continue(
        self, tokens: Sequence[int], hidden: torch.Tensor | None, more: bool
    ) -> torch.Tensor:
        """Put `tokens` after the state the engine holds (`more`: more of the prompt follows)
        → the last one's hidden [1, H] (the state's own last row, `hidden`, where there are
        none). A state with a prompt part-way in (a prefix cache's part boundary) takes them
        as that prompt's next part."""
        if tokens and self.engine.prompt_part_way():
            return self.engine.prefill_part(self.model, self.ffn, tokens, more)[-1:]
        if tokens and self.engine.extends_exactly(self.model):
            return self.engine.extend(self.model, self.ffn, tokens)
        for token in tokens:
            hidden = self.engine.decode_step(self.model, self.ffn, token)
        assert hidden is not None
        return hidden

    def takes_prompt_in_batch(self, max_tokens: int) -> bool:
        """Whether up to `max_tokens` more of its prompt may go in through `advance_together`
        (a batched step): not started, its engine takes prompts in batched steps, the prompt's
        rows need not be kept nor a restored state's last row given, and (a chunk short of the
        rest, after parts of it went in on their own, or after a state it resumes) only where
        the engine extends a prefill exactly."""
        if self.started or self.finished or max_tokens < 1:
            return False
        if self.keep_prompt_rows or self.resume_hidden is not None:
            return False
        if self.engine.joining_batch_key(self.model) is None:
            return False
        if self.resumes:  # its rows continue a held state, as a prefill's next chunk does
            return self.engine.extends_exactly(self.model)
        rest = len(self.prompt_ids) - self.prompt_done
        whole = rest <= max_tokens and self.prompt_done == 0
        return whole or self.engine.extends_exactly(self.model)

    def _prompt_chunk(self, max_tokens: int) -> list[int]:
        """The next up to `max_tokens` prompt tokens for a batched step (refused where
        `takes_prompt_in_batch` says no)."""
        if not self.takes_prompt_in_batch(max_tokens):
            raise InvariantViolation("the session cannot take its prompt in a batched step")
        return self.prompt_ids[self.prompt_done : self.prompt_done + max_tokens]

    def step_part(self, max_rows: int) -> int | None:
        """`step`, in parts of about `max_rows` rows of work where the engine's step recomputes
        more (`Engine.step_work`) → the next token after the last part, None before it."""
        if self._step_parts is None:
            if self.engine.step_work() <= max_rows:
                return self.step()
            self.check_can_step()
            self._step_parts = self.engine.decode_step_parts(
                self.model, self.ffn, self.tokens[-1], max_rows
            )
        with torch.inference_mode():
            t0 = time.perf_counter()
            hidden = next(self._step_parts)
            self._parts_ms += (time.perf_counter() - t0) * 1000
            if hidden is None:
                return None
            self._step_parts = None
            t0 = time.perf_counter()
            self.logits = next_token_logits(self.model, hidden)
            token = self.sampler.pick(self.logits)
            self.step_ms.append(self._parts_ms + (time.perf_counter() - t0) * 1000)
            self._parts_ms = 0.0
        self._accept(token)
        return token

    @property
    def mid_step(self) -> bool:
        """Whether a step taken in parts is under way (its engine is between parts)."""
        return self._step_parts is not None

    def step(self) -> int:
        """Feed the last token as one decode step → the next token."""
        self.check_can_step()
        with torch.inference_mode():
            t0 = time.perf_counter()
            with recording(self.decode_kinds):  # the engine's step, as bench records it
                hidden = self.engine.decode_step(self.model, self.ffn, self.tokens[-1])
            self.logits = next_token_logits(self.model, hidden)
            token = self.sampler.pick(self.logits)
            self.step_ms.append((time.perf_counter() - t0) * 1000)
        self._accept(token)
        return token

    def stop(self) -> None:
        """End the session early on the caller's behalf (a stop string, a client gone)."""
        self.finished = True
        self.finish_reason = "stop"

    def result(self) -> GenerationResult:
        return GenerationResult(
            list(self.tokens),
            self.finish_reason,
            self.prefill_ms,
            list(self.step_ms),
            frozenset(self.decode_kinds),
        )

    def _accept(self, token: int) -> None:
        # A stop token is emitted, then ends the run.
        self.tokens.append(token)
        if token in self.stop_ids:
            self.stop()
        elif len(self.tokens) >= self.budget:
            self.finished = True


def generate(
    engine: Engine,
    model: Model,
    ffn: FfnBackend,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampler: Sampler | None = None,
    on_token: TokenCallback | None = None,
    stop_ids: frozenset[int] | None = None,
    max_positions: int | None = None,
    resume_hidden: torch.Tensor | None = None,
    after_prefill: Callable[[GenerationSession], None] | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens (a stop token is emitted, then ends the run).

    `max_positions` caps prompt + generated tokens (the model's context by default);
    `resume_hidden` continues a restored state (see `GenerationSession`); `after_prefill` sees
    the session once the prompt is in (e.g. to snapshot the engine)."""
    gen = GenerationSession(
        engine,
        model,
        ffn,
        prompt_ids,
        max_new_tokens,
        sampler,
        stop_ids,
        max_positions,
        resume_hidden=resume_hidden,
    )
    if gen.finished:
        return gen.result()
    token = gen.prefill()
    if after_prefill is not None:
        after_prefill(gen)
    while True:
        if on_token is not None and on_token(token):
            gen.stop()
        if gen.finished:
            return gen.result()
        token = gen.step()


HEAD_ROWS = 64  # hidden rows per LM-head product where many positions' logits are wanted


def teacher_forced_hidden(
    engine: Engine,
    model: Model,
    ffn: FfnBackend,
    ids: Sequence[int],
    prompt_len: int,
    prompt_rows: bool = False,
) -> Iterator[torch.Tensor]:
    """Prefill `ids[:prompt_len]`, then feed each later id as a decode step regardless of what
    the model would pick → the engine's hidden [1, H] after the prompt and after every fed id.

    `prompt_rows`: first every earlier prompt row the prefill returned (all of them for an
    engine that runs the prompt in one pass; check the count: some return only the last)."""
    with torch.inference_mode():
        if prompt_rows:
            yield from engine.prefill_all(model, ffn, ids[:prompt_len]).split(1)  # [1, H] each
        else:
            yield engine.prefill(model, ffn, ids[:prompt_len])
        for token in ids[prompt_len:]:
            yield engine.decode_step(model, ffn, token)


def logits_of(model: Model, hidden_rows: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Next-token logits [V] of each hidden row [1, H], in order, through one LM-head product
    per `HEAD_ROWS` rows: on a CPU a product of 64 rows costs about what 3 single rows do."""
    batch: list[torch.Tensor] = []
    with torch.inference_mode():
        for row in hidden_rows:
            batch.append(row)
            if len(batch) == HEAD_ROWS:
                yield from final_logits(model, torch.cat(batch))
                batch = []
        if batch:
            yield from final_logits(model, torch.cat(batch))


def teacher_forced_logits(
    engine: Engine,
    model: Model,
    ffn: FfnBackend,
    ids: Sequence[int],
    prompt_len: int,
    prompt_rows: bool = False,
) -> torch.Tensor:
    """Next-token logits after the prompt and after every fed token (`teacher_forced_hidden`),
    [len(ids) − prompt_len + 1, V]; with `prompt_rows`, after every prompt position too
    ([len(ids), V] for an engine whose prefill returns every row)."""
    hidden = teacher_forced_hidden(engine, model, ffn, ids, prompt_len, prompt_rows)
    return torch.stack(list(logits_of(model, hidden)))
