"""Batched decode: one step for several sessions' engines at once, so the weights are read once
for all of them instead of once per session (what makes many concurrent streams cheaper than
the same streams in turn).

Engines batch when their `batch_key()`s are equal (`batch_groups` sorts a set of engines into
such groups); each engine keeps its own state and position, and each row attends only over its
own engine's keys. A row's result does not depend on which other rows share its step beyond the
order of float sums (on the CPU's compiled layer not even that: it is bit-identical).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from larql.inference.engine import Engine
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
    engines: Sequence[Engine], model: Model, ffn: FfnBackend, token_ids: Sequence[int]
) -> torch.Tensor:
    """Append token_ids[i] to engines[i] at its next position, all in one step → each engine's
    hidden [B, H] (row i as `engines[i].decode_step` would return it)."""
    if len(engines) != len(token_ids) or not engines:
        raise InvariantViolation("decode_batch needs one token per engine, and at least one")
    if len(engines) == 1:
        return engines[0].decode_step(model, ffn, token_ids[0])
    if len({id(engine) for engine in engines}) != len(engines):
        raise InvariantViolation("an engine appears twice in one batch")
    key = engines[0].batch_key()
    if key is None or any(engine.batch_key() != key for engine in engines):
        raise InvariantViolation("these engines do not batch together (batch_key differs)")
    for engine in engines:
        engine._require_prefill()
    rows, inputs = embed_rows(model, token_tensor(model, list(token_ids)))  # [B, H], …
    hidden = type(engines[0])._step_batch(engines, model, ffn, rows, inputs)
    for engine in engines:
        engine.position += 1
    return hidden
