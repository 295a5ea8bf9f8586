"""turbo-quant's decode attention on the CPU through the compiled extension: the codes (2, 3 or
4 bits an index; encoded by `compiled_codec`) attended in place by `coded_attention`.

The torch path decodes every stored row back to floats each step (centroids × norm, plus the
mean with centering) and concatenates them with the exact rows: ~4 copies of the history a layer
and step, and some 30 small torch operators per layer whose dispatch costs more than the
arithmetic at a short context. Here one call per layer attends: the extension reads the codes as
stored, scores the exact rows (sinks, recent rows, the new row) in the model's basis and merges
the two softmax states (the formulas are in `coded_attention.cpp`), the same attention as the
torch path's up to float rounding. A leaving row is encoded by one call too
(`compiled_codec.encode_rows`).

Used where it applies: a float32 model on the CPU with the extension built, the rotated-basis
attention (not `attention=sdpa`, the torch reference), `TurboQuantCodec` codes of one codec
for K and V (`compiled_codec.compiled_codes`); the attention also needs a layer without soft
caps or attention sinks whose K/V no other layer shares, and that attends every row it holds: a
full-attention layer, or a sliding layer whose store holds just its window (`codes_in_place`).
Everything else keeps the torch path.
"""

from __future__ import annotations

from types import ModuleType

import torch

from larql.inference.layer import effective_window, kept_rows
from larql.inference.shared_kv import SharedKv
from larql.kernels.ran import FUSED_PIECES, ran
from larql.kv.turbo_quant.codebook import codebook
from larql.kv.turbo_quant.codec import TurboQuantCodec
from larql.kv.turbo_quant.compiled_codec import or_empty
from larql.kv.turbo_quant.store import QuantisedLayer
from larql.models.model import Model


def attends_in_place(
    model: Model, layer: int, shared: SharedKv, store: QuantisedLayer | None = None
) -> bool:
    """Whether a layer's decode attention can run over its stored codes in the extension: a
    float32 model on the CPU, a layer without soft caps or attention sinks whose K/V no other
    layer shares, whose query sees every row held: a full-attention layer, or a sliding one
    whose `store` holds its window and no more (the extension masks nothing)."""
    if model.device.type != "cpu" or model.dtype != torch.float32 or shared.is_source(layer):
        return False
    if model.config.arch.attn_softcap is not None:
        return False
    if model.weights.layers[layer].attn_sinks is not None:
        return False
    window = effective_window(model, layer, None)
    return window is None or (store is not None and holds_its_window(store, window))


def holds_its_window(store: QuantisedLayer, window: int) -> bool:
    """Whether `store` keeps at most the rows a query of a layer of this sliding `window` sees
    beside the new row: no sinks, and its codes' and recent rows' room the window's."""
    keep = store.codes.keep
    if keep is None or store.sink_room != 0:
        return False
    return keep + store.recent_room == kept_rows(window)


def codes_in_place(
    model: Model,
    layer: int,
    store: QuantisedLayer,
    rotation: torch.Tensor | None,
    shared: SharedKv,
) -> bool:
    """Whether this layer's step attends over its codes in place (in the extension, where
    `cpu_extension()` has it)."""
    in_place = attends_in_place(model, layer, shared, store)
    return rotation is not None and store.compiled and in_place


def attend_coded(
    kernels: ModuleType,
    model: Model,
    layer: int,
    store: QuantisedLayer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rotation: torch.Tensor,
) -> torch.Tensor:
    """The decode query q [Hq, 1, D] over the layer's stored rows and the new row k, v
    [Hkv, 1, D] (stored by the caller after the step) → [1, q_dim]."""
    cfg = model.config
    codec: TurboQuantCodec = store.layout.k_codec  # type: ignore[assignment]
    rows, codes = rows_in_place(store, k, v)
    centroids = codebook(codec.rotated_dim, codec.bits).centroids
    ran(FUSED_PIECES)
    out = kernels.coded_attention(
        q[:, 0],
        rotation,
        codes,
        store.kv_heads,
        centroids,
        or_empty(store.mean),
        rows,
        cfg.attn_scale,
    )  # [Hq, D]
    return out.view(1, cfg.q_dim_of(layer))


def rows_in_place(
    store: QuantisedLayer, k: torch.Tensor, v: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """What the extension's attention reads of a layer, as stored: its exact rows (sinks,
    recent rows, then the new row k, v [Hkv, 1, D]), each [E, 2, Hkv, D] float16 / float32, and
    its coded rows uint8 [n, row_bytes] (n may be 0)."""
    rows = [part.rows for part in (store.sinks, store.recent) if len(part)]
    rows.append(torch.stack((k[:, 0], v[:, 0])).unsqueeze(0))  # the new row [1, 2, Hkv, D]
    if len(store.codes):
        return rows, store.codes.rows
    return rows, torch.empty(0, store.row_bytes, dtype=torch.uint8)
