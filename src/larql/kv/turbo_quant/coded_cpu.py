"""turbo-quant's decode step on the CPU through the compiled extension: rows encoded by
`coded_encode` and attended in place by `coded_attention` (2, 3 or 4 bits an index).

The torch path decodes every stored row back to floats each step (centroids × norm, plus the
mean with centering) and concatenates them with the exact rows: ~4 copies of the history a layer
and step, and some 30 small torch operators per layer whose dispatch costs more than the
arithmetic at a short context. Here one call per layer attends: the extension reads the codes as
stored, scores the exact rows (sinks, recent rows, the new row) in the model's basis and merges
the two softmax states (the formulas are in `coded_attention.cpp`), the same attention as the
torch path's up to float rounding. A leaving row is encoded by one call too, with the torch
codec's arithmetic (a coordinate within float rounding of a cell boundary may take the
neighbouring cell).

Used where it applies: a float32 model on the CPU with the extension built, the rotated-basis
attention (not `attention=sdpa`, the torch reference), `TurboQuantCodec` codes of one codec
for K and V (`compiled_codes`); the attention also needs a full-attention layer without
soft caps or attention sinks whose K/V no other layer shares (`coded_kernels`). Everything else
keeps the torch path.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch

from larql.inference.layer import effective_window
from larql.inference.linear import load_block_kernels
from larql.inference.shared_kv import SharedKv
from larql.kv.turbo_quant.codebook import codebook
from larql.kv.turbo_quant.codec import RowCodec, TurboQuantCodec
from larql.kv.turbo_quant.rotation import rotation_matrix
from larql.models.model import Model

if TYPE_CHECKING:
    from larql.kv.turbo_quant.store import QuantisedLayer


def _kernels() -> ModuleType | None:
    kernels = load_block_kernels()
    return kernels if kernels is not None and hasattr(kernels, "coded_encode") else None


def compiled_codes(model: Model, k_codec: RowCodec, v_codec: RowCodec) -> bool:
    """Whether a layer of `model` with these codecs is encoded and attended by the extension
    (the engine asks only for its rotated-basis attention, not for `attention=sdpa`)."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return False
    if not isinstance(k_codec, TurboQuantCodec) or v_codec is not k_codec:
        return False
    if k_codec.rotated_dim % 8:  # whole bytes per 8 indices at every width (2, 3 or 4 bits)
        return False
    return _kernels() is not None


def coded_kernels(
    model: Model, layer: int, store: QuantisedLayer, rotation: torch.Tensor | None,
    shared: SharedKv,
) -> ModuleType | None:  # fmt: skip
    """The extension where this layer's step attends over its codes in place, else None."""
    if rotation is None or not store.compiled or shared.is_source(layer):
        return None
    if (
        model.config.arch.attn_softcap is not None
        or model.weights.layers[layer].attn_sinks is not None
    ):
        return None
    if effective_window(model, layer, None) is not None:
        return None
    return _kernels()


def encode_rows(
    codec: TurboQuantCodec, rows: torch.Tensor, mean: torch.Tensor | None
) -> torch.Tensor:
    """rows [S, 2, Hkv, D] (float32 or float16) minus `mean` [2, Hkv, D] → one code row per
    token, uint8 [S, row_bytes] ([K heads ; V heads]); the torch codec where the extension is
    not built."""
    kernels = _kernels()
    if kernels is None:
        s = rows.shape[0]
        x = rows.float() if mean is None else rows.float() - mean
        return codec.encode(x.reshape(-1, rows.shape[-1])).view(s, -1)
    book = codebook(codec.rotated_dim, codec.bits)
    rotation = rotation_matrix(codec.rotated_dim, torch.float32, rows.device)
    return kernels.coded_encode(
        rows, _or_empty(mean), rotation, book.boundaries, book.centroids, codec.norm_correction
    )


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
    exact = [part for part in (store.sinks, store.recent) if len(part)]
    rows = [part.rows for part in exact]  # each [E, 2, Hkv, D] float16 / float32
    rows.append(torch.stack((k[:, 0], v[:, 0])).unsqueeze(0))  # the new row [1, 2, Hkv, D]
    if len(store.codes):
        codes = store.codes.rows  # [n, row_bytes]
    else:
        codes = torch.empty(0, store.row_bytes, dtype=torch.uint8)
    centroids = codebook(codec.rotated_dim, codec.bits).centroids
    out = kernels.coded_attention(
        q[:, 0], rotation, codes, store.kv_heads, centroids, _or_empty(store.mean), rows,
        cfg.attn_scale,
    )  # fmt: skip  # [Hq, D]
    return out.view(1, cfg.q_dim_of(layer))


_EMPTY = torch.empty(0)


def _or_empty(mean: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if mean is None else mean
