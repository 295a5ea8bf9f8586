"""turbo-quant's CPU decode step in one compiled call (`decode_layers_coded`), for one session
or a batch of them: every layer's QKV, output projection and MLP as `standard`'s compiled step
runs them (each weight read once for all rows), around the attention over each session's
codes in place (`coded_cpu`'s arithmetic) and the store's update (the new row kept exact or at
int8 among the recent rows, the row leaving them coded).

Layer by layer the step costs some 30 small calls a layer (projections, attention, store
update, MLP) and Python's work around each; in one call it costs what `standard`'s does plus
the coded attention, so the quantised step is no slower than `standard`'s at a short context.

It applies where every layer's attention runs over its codes in place (`coded_cpu`: a float32
model on the CPU, full-attention layers, one codec for K and V), the compiled layer takes every
layer (`fused_layer`: plain layers in GGUF blocks), there are no per-layer inputs, and each
session's sink rows are all in (the prompt was at least `sinks` tokens). The layers of a
session hold their rows at the same places (they see the same tokens), so one set of places
serves them all; where they do not, or anything else differs, the layer-by-layer step runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from larql.inference.ffn import FfnBackend
from larql.inference.fused_layer import layer_arguments
from larql.inference.shared_kv import SharedKv
from larql.kernels.cpu import cpu_extension
from larql.kernels.ran import FUSED_LAYERS, ran
from larql.kv.rows import GrowableRows
from larql.kv.turbo_quant.codec import RowCodec
from larql.kv.turbo_quant.coded_cpu import attends_in_place
from larql.kv.turbo_quant.store import QuantisedLayer
from larql.models.model import Model

KEEP_NEW, CODE_OLDEST, CODE_NEW = 0, 1, 2  # what a step does with its new row (the call's modes)


@dataclass
class _Places:
    """One session's stores as the call reads them: per layer its storages, and the places
    every layer shares."""

    codes: list[torch.Tensor]  # uint8 [capacity, row_bytes] each
    recent: list[torch.Tensor]  # [capacity, 2, Hkv, D] float16 or int8 each (or empty)
    scales: list[torch.Tensor]  # float16 [capacity, 2, Hkv, 1] each (int8 recent rows)
    sinks: list[torch.Tensor]  # float16 [≥ sinks, 2, Hkv, D] each (with sink rows)
    means: list[torch.Tensor]  # float32 [2, Hkv, D] each (with centering)
    places: list[int]  # sinks, codes' first and end, recent's first and end, mode
    mode: int


def coded_layers_step(
    engines: Sequence[object], model: Model, ffn: FfnBackend, rows: torch.Tensor
) -> torch.Tensor | None:
    """rows [B, H]: engine i's decode row at its position → the residuals after every layer
    [B, H], each engine's stores updated with its row; None where the one call does not apply
    (nothing is changed). `engines`: turbo-quant (or kv-quant) engines on the torch path, of
    one layout."""
    kernels = cpu_extension()
    if kernels is None:
        return None
    cfg = model.config
    stores: list[list[QuantisedLayer]] = [engine._layers for engine in engines]  # type: ignore[attr-defined]
    if any(layers is None for layers in stores):
        return None
    if not _model_in_place(model) or not all(_one_codec(layers) for layers in stores):
        return None
    codec = stores[0][0].layout.k_codec  # a TurboQuantCodec or kv-quant's IntCodec
    layers = range(cfg.num_layers)
    positions = [engine.position for engine in engines]  # type: ignore[attr-defined]
    arguments = layer_arguments(model, layers, rows, ffn, positions)
    if arguments is None:
        return None
    places = [_session_places(layers_of, codec) for layers_of in stores]
    if any(p is None for p in places):
        return None
    sessions = [p for p in places if p is not None]
    leading, bits = arguments
    per_layer = [
        [
            [getattr(s, name)[layer] for s in sessions] if getattr(sessions[0], name) else []
            for layer in layers
        ]
        for name in ("codes", "recent", "scales", "sinks", "means")
    ]
    ran(FUSED_LAYERS)
    out = kernels.decode_layers_coded(
        *leading,
        *per_layer,
        [n for s in sessions for n in s.places],
        cfg.num_heads,
        cfg.attn_scale,
        bits,
        *codec.compiled_codes(rows.device),
    )
    for layers_of, session in zip(stores, sessions, strict=True):
        _commit(layers_of, session.mode)
    return out


def _model_in_place(model: Model) -> bool:
    """Whether every layer of `model` attends over its codes in place (`attends_in_place`),
    worked out once per model, device and dtype."""
    key = ("coded_layers_in_place", model.device, model.dtype)
    cached = model.runtime.get(key)
    if cached is None:
        shared = SharedKv(model.config)
        cached = all(attends_in_place(model, i, shared) for i in range(model.config.num_layers))
        model.runtime[key] = cached
    return bool(cached)


def _one_codec(layers: list[QuantisedLayer]) -> bool:
    """Whether a session's layers are coded by the extension, one codec for K and V and for
    them all (a restored state holds equal codec objects, not one)."""
    codec = layers[0].layout.k_codec
    return all(
        store.compiled
        and _same_codec(store.layout.k_codec, codec)
        and _same_codec(store.layout.v_codec, codec)
        for store in layers
    )


def _same_codec(a: RowCodec, b: RowCodec) -> bool:
    return a is b or (type(a) is type(b) and vars(a) == vars(b))


def _session_places(layers: list[QuantisedLayer], codec: RowCodec) -> _Places | None:
    """One session's places, room reserved for what its step writes: None where its sink rows
    are not all in or its layers hold their rows at different places."""
    first = layers[0]
    if len(first.sinks) != first.sink_room or (first.sink_room and first.sinks._start):
        return None
    if first.recent_room == 0:
        mode = CODE_NEW
    else:
        mode = CODE_OLDEST if len(first.recent) >= first.recent_room else KEEP_NEW
    row_bytes = first.row_bytes
    codes = [_room(s.codes, mode != KEEP_NEW, _empty(row_bytes)) for s in layers]
    int8 = first.recent.bits == 8
    dim = codec.dim  # type: ignore[attr-defined]
    like = torch.empty(0, 2, first.kv_heads, dim, dtype=torch.int8 if int8 else first.exact)
    keep = mode != CODE_NEW
    recent = [_room(s.recent.codes, keep, like) for s in layers]
    scales_like = torch.empty(0, 2, first.kv_heads, 1, dtype=torch.float16)
    scales = [_room(s.recent.scales, keep, scales_like) for s in layers] if int8 else []

    def span(store: QuantisedLayer) -> tuple[int, ...]:
        scales = store.recent.scales if int8 else store.recent.codes  # each scale beside its row
        recent = store.recent.codes
        return (
            store.codes._start,
            store.codes._end,
            recent._start,
            recent._end,
            scales._start,
            scales._end,
        )

    spans = {span(s) for s in layers}
    if len(spans) != 1:
        return None
    codes_first, codes_end, recent_first, recent_end, *scale_span = spans.pop()
    if scale_span != [recent_first, recent_end]:
        return None
    sinks = [s.sinks._data for s in layers] if first.sink_room else []
    means = [s.mean for s in layers] if first.mean is not None else []
    if any(t is None for t in (*sinks, *means)):
        return None
    places = [len(first.sinks), codes_first, codes_end, recent_first, recent_end, mode]
    return _Places(codes, recent, scales, sinks, means, places, mode)  # type: ignore[arg-type]


def _empty(row_bytes: int) -> torch.Tensor:
    return torch.empty(0, row_bytes, dtype=torch.uint8)


def _room(rows: GrowableRows, needed: bool, like: torch.Tensor) -> torch.Tensor:
    """The rows' storage, with room for one more row where `needed` (made like `like` while
    empty; `like` itself where not needed and none is made)."""
    data = rows._data
    if data is not None and (not needed or rows._end < rows.capacity):  # most steps
        return data
    if not needed:
        return like
    reserved = rows.reserve_back(1, like)
    assert reserved is not None
    return reserved[0]


def _commit(layers: list[QuantisedLayer], mode: int) -> None:
    """Count what the call wrote in each layer's store (as `GrowableRows.commit` and
    `drop_front` would: the rows' ends moved; every step asks it of every layer)."""
    coded, kept, left = mode != KEEP_NEW, mode != CODE_NEW, mode == CODE_OLDEST
    for store in layers:
        if coded:
            store.codes._end += 1
        if kept:
            parts = store.recent.storages() if store.recent.bits == 8 else [store.recent.codes]
            for part in parts:
                part._end += 1
                if left:
                    part.drop_front(1)
