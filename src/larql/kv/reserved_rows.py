"""A step's new rows placed in their sessions' K/V buffers for the compiled layers' one call
(`fused_layers_rows`), and a new prompt taken whole in that call: the way `standard` runs a
short prompt, which the quantised engines share for their exact prefill."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from larql.inference.ffn import FfnBackend
from larql.inference.fused_layer import StoreRows, fused_layers_rows, layers_compile
from larql.inference.linear import model_block_rows
from larql.kv.buffers import KvBuffer
from larql.models.model import Model


def prompt_in_one_call(
    model: Model,
    ffn: FfnBackend,
    rows: torch.Tensor,
    buffers: Sequence[KvBuffer],
    layer_inputs: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A new session's prompt rows [S, H] at positions 0.. through every layer in one compiled
    call, as `standard`'s own prefill takes them: each layer's K/V written into `buffers`
    (fresh `KvBuffer`s, one a layer, keeping every row), each layer's input rows into
    `layer_inputs` (float32 [L, S, H], where given) → the hidden rows [S, H]; None, with
    nothing written, where the call does not take them (a long prompt, another model)."""
    n, layers = rows.shape[0], range(model.config.num_layers)
    if n > model_block_rows(model) or not layers_compile(model, layers, rows, ffn):
        return None
    reserved = rows_reserved(model, rows, [buffers], [n], [None])
    if reserved is None:
        return None
    h = fused_layers_rows(model, layers, rows, [0], [n], [], ffn, None, reserved, layer_inputs)
    if h is not None:
        for buffer in buffers:
            buffer.commit_rows(n)
    return h


def rows_reserved(
    model: Model,
    rows: torch.Tensor,
    layer_lists: Sequence[Sequence[object]],
    counts: Sequence[int],
    slots: Sequence[tuple[list[torch.Tensor], list[torch.Tensor], int, int] | None],
) -> list[StoreRows] | None:
    """Per layer, each of the step's rows' (K storage, V storage, first row its query sees,
    slot): session i's counts[i] rows from its `step_slots` reservation, or reserved layer by
    layer in its buffers layer_lists[i] where it has none (a new session: its storage made
    here). None where a session's layer is not a plain `KvBuffer` that keeps every row (a
    sliding layer, sinks)."""
    cfg = model.config
    per_session = []  # per session, per layer: (K storage, V storage, first, first new row)
    for buffers, n, slot in zip(layer_lists, counts, slots, strict=True):
        if slot is not None:
            keys, values, first, new = slot
            per_session.append([(k, v, first, new) for k, v in zip(keys, values, strict=True)])
            continue
        mine = []
        for layer, buffer in enumerate(buffers):
            if type(buffer) is not KvBuffer or buffer.keep is not None:
                return None
            like = rows.new_empty(1, cfg.kv_heads_of(layer), cfg.head_dim_of(layer))
            got = buffer.decode_slots(n, like)
            if got is None or got[0].dtype != torch.float32:
                return None
            mine.append(got)
        per_session.append(mine)
    reserved: list[StoreRows] = []
    for layer in range(cfg.num_layers):
        k_stores: list[torch.Tensor] = []
        v_stores: list[torch.Tensor] = []
        firsts: list[int] = []
        places: list[int] = []
        for session, n in zip(per_session, counts, strict=True):
            keys, values, first, new = session[layer]
            k_stores += [keys] * n
            v_stores += [values] * n
            firsts += [first] * n
            places += range(new, new + n)
        reserved.append((k_stores, v_stores, firsts, places))
    return reserved
