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
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from itertools import chain

import torch

from larql.inference.engine import Engine, backend_name
from larql.inference.errors import InvariantViolation
from larql.inference.ffn import FfnBackend
from larql.inference.layer import embed_rows, token_tensor
from larql.models.model import Model


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
    hidden = type(engines[0])._step_batch(engines, model, ffn, rows, inputs)
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
    hidden = type(engines[0])._advance_batch(engines, model, ffn, rows, counts, inputs)
    for engine, new, n in zip(engines, fresh, counts, strict=True):
        if new:
            engine._started(n)
        else:
            engine.position += n
    return list(hidden.split(counts))
