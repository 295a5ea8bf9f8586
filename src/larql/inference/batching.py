"""Batched decode: one step for several sessions' engines at once, so the weights are read once
for all of them instead of once per session (what makes many concurrent streams cheaper than
the same streams in turn).

Engines batch when their `batch_key()`s are equal (`batch_groups` sorts a set of engines into
such groups); each engine keeps its own state and position, and each row attends only over its
own engine's keys. A row's result does not depend on which other rows share its step beyond the
order of float sums (on the CPU's compiled layer not even that: it is bit-identical).

`advance_batch` is the same step where some engines take several rows: a fresh engine its
prompt (or the prompt's first chunk), an engine part-way through its prompt the next chunk.
A new stream's prompt then rides in the running streams' step instead of taking a forward
pass of its own, and the running streams lose no step to it.

Failures: a session's own part of a step (its engine's attention over its own state) may run
isolated (`IsolatedRows`): where it raises, that session's rows get a placeholder and the step
goes on; rows are independent in every part the sessions share (projections, norms, FFN, LM
head), so the others' rows are what they would have been, and `RowsFailed` then names the
failed sessions (the others' positions advanced). Where a shared part fails, an engine class
that can puts every engine back as it was before the step and raises `StepRolledBack`, so the
caller may step each session alone; any other exception leaves the engines' states undefined.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from itertools import chain
from typing import Any

import torch

from larql.inference.engine import Engine, backend_name
from larql.inference.errors import InvariantViolation
from larql.inference.ffn import FfnBackend
from larql.inference.layer import RowAttention, embed_rows, token_tensor
from larql.models.model import Model


class RowsFailed(Exception):
    """Some sessions' own parts of a batched step raised; the others' rows are good.
    `hidden`: every engine's rows (placeholders for the failed ones); `failures`: the index of
    each failed engine → what it raised."""

    def __init__(self, hidden: Any, failures: dict[int, Exception]) -> None:
        first = next(iter(failures.values()))
        super().__init__(f"{len(failures)} of a batched step's sessions failed: {first}")
        self.hidden = hidden
        self.failures = failures


class StepRolledBack(Exception):
    """A part of a batched step that every session shares failed, and every engine in it is
    back in its state before the step (positions unchanged)."""


class IsolatedRows:
    """Runs each session's own part of a batched step (`RowAttention`) so that an exception
    fails that session only: its rows get zeros and the step goes on (a failed session's
    later parts are skipped)."""

    def __init__(self) -> None:
        self.failures: dict[int, Exception] = {}

    def __call__(self, attend_row: RowAttention) -> RowAttention:
        def isolated(
            i: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
        ) -> torch.Tensor:
            if i not in self.failures:
                try:
                    return attend_row(i, q, k, v)
                except Exception as e:
                    self.failures[i] = e
            return q.new_zeros(q.shape[1], q.shape[0] * q.shape[2])  # [n, Hq·D]

        return isolated

    def check(self, hidden: torch.Tensor) -> torch.Tensor:
        """The step's rows [R, H], or `RowsFailed` where a session's part raised."""
        if self.failures:
            raise RowsFailed(hidden, dict(self.failures))
        return hidden


def batch_groups(engines: Sequence[Engine]) -> list[list[int]]:
    """Indices of `engines` grouped by batch key, in first-seen order; an engine whose key is
    None is a group of its own."""
    groups: dict[Hashable, list[int]] = {}
    alone: list[list[int]] = []
    for i, engine in enumerate(engines):
        key = engine.batch_key()
        if key is None:
            alone.append([i])
        else:
            groups.setdefault(key, []).append(i)
    return [*groups.values(), *alone]


def decode_batch(
    engines: Sequence[Engine],
    model: Model,
    ffn: FfnBackend,
    token_ids: Sequence[int] | torch.Tensor,
) -> torch.Tensor:
    """Append token_ids[i] to engines[i] at its next position, all in one step → each engine's
    hidden [B, H] (row i as `engines[i].decode_step` would return it). token_ids may be a
    [B] int64 tensor on the model's device (the picks of a step not yet read: nothing waits
    for them); then even one engine takes the batched step."""
    if len(engines) != len(token_ids) or not engines:
        raise InvariantViolation("decode_batch needs one token per engine, and at least one")
    on_device = isinstance(token_ids, torch.Tensor)
    if len(engines) == 1 and not on_device:
        return engines[0].decode_step(model, ffn, token_ids[0])
    if len({id(engine) for engine in engines}) != len(engines):
        raise InvariantViolation("an engine appears twice in one batch")
    key = engines[0].batch_key()
    if key is None or any(engine.batch_key() != key for engine in engines):
        raise InvariantViolation("these engines do not batch together (batch_key differs)")
    for engine in engines:
        engine._require_prefill()
    ids = token_ids if on_device else token_tensor(model, list(token_ids))  # [B]
    rows, inputs = embed_rows(model, ids)  # [B, H], …
    try:
        hidden = type(engines[0])._step_batch(engines, model, ffn, rows, inputs)
    except RowsFailed as e:
        for i, engine in enumerate(engines):
            if i not in e.failures:
                engine.position += 1
        raise
    for engine in engines:
        engine.position += 1
    return hidden


def advance_batch(
    engines: Sequence[Engine],
    model: Model,
    ffn: FfnBackend,
    token_lists: Sequence[Sequence[int]],
) -> list[torch.Tensor]:
    """Append token_lists[i] to engines[i] at its next positions, all in one step: a decode
    token for an engine whose prompt is in, a prompt or the next chunk of one otherwise (an
    engine with no prompt yet starts with it) → each engine's hidden rows [n_i, H], as its own
    `prefill` / `extend` / `decode_step` would return them (every row; the last is the one a
    next token is read from)."""
    counts = [len(tokens) for tokens in token_lists]
    if len(engines) != len(token_lists) or not engines or min(counts) < 1:
        raise InvariantViolation("advance_batch needs one or more tokens per engine")
    if len({id(engine) for engine in engines}) != len(engines):
        raise InvariantViolation("an engine appears twice in one batch")
    fresh = [not engine.prefilled for engine in engines]
    keys = [engine.joining_batch_key(model) for engine in engines]
    if keys[0] is None or any(key != keys[0] for key in keys):
        raise InvariantViolation("these engines do not batch together (batch_key differs)")
    for engine, new in zip(engines, fresh, strict=True):
        if new:
            engine._check_ffn(ffn)
            engine._backend = backend_name(model)
            engine._begin_in_batch(model)
    ids = token_tensor(model, list(chain.from_iterable(token_lists)))
    rows, inputs = embed_rows(model, ids)  # [R, H], …
    failures: dict[int, Exception] = {}
    try:
        hidden = type(engines[0])._advance_batch(engines, model, ffn, rows, counts, inputs)
    except RowsFailed as e:
        hidden, failures = e.hidden, e.failures
    for i, (engine, new, n) in enumerate(zip(engines, fresh, counts, strict=True)):
        if i in failures:
            continue
        if new:
            engine._started(n)
        else:
            engine.position += n
    rows_of = list(hidden.split(counts))
    if failures:
        raise RowsFailed(rows_of, failures)
    return rows_of
