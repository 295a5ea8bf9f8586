"""kv-quant's decode attention on the CPU over its integer codes in place (the extension's
`grouped_attention`): each stored row's key and value vectors decoded group by group (index ·
scale + zero point) inside the call, scored and weighed without a decoded copy of the history,
and merged with the exact rows (sinks, recent rows, the new one). With `rotate`, the query is
rotated into the codes' Walsh–Hadamard basis and the sum rotated back once, as turbo-quant's
step does. The same attention as the torch path's (which decodes every row each step) up to
float rounding.

Used where it applies: a float32 model on the CPU with the extension built, `IntCodec` or
`Fp8Codec` codes of one codec for K and V whose groups fill whole bytes, on a layer where
`attends_in_place` holds; everything else keeps the torch path. Both are encoded by the
extension too (`grouped_encode`, the torch codec's bytes), so their step takes the one call.
"""

from __future__ import annotations

from types import ModuleType

import torch

from larql.inference.shared_kv import SharedKv
from larql.kernels.cpu import cpu_extension
from larql.kernels.ran import FUSED_PIECES, ran
from larql.kv.kv_quant.codecs import Fp8Codec, IntCodec
from larql.kv.turbo_quant.codec import RowCodec
from larql.kv.turbo_quant.coded_cpu import attends_in_place, rows_in_place
from larql.kv.turbo_quant.rotation import rotation_matrix
from larql.kv.turbo_quant.store import QuantisedLayer
from larql.models.model import Model


def grouped_codes(model: Model, k_codec: RowCodec, v_codec: RowCodec) -> bool:
    """Whether a layer of `model` with these codecs is encoded by the extension (and so may take
    the one-call step): a float32 model on the CPU, one `IntCodec` or `Fp8Codec` for K and V
    whose groups fill whole bytes."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return False
    if not isinstance(k_codec, IntCodec | Fp8Codec) or v_codec is not k_codec:
        return False
    return k_codec.padded_dim % 8 == 0 and cpu_extension() is not None


def grouped_in_place(model: Model, layer: int, store: QuantisedLayer, shared: SharedKv) -> bool:
    """Whether this layer's step attends over its integer codes in place (in the extension,
    where `cpu_extension()` has it)."""
    codec, v_codec = store.layout.k_codec, store.layout.v_codec
    # one configuration for K and V (a restored state holds two equal codec objects)
    if not isinstance(codec, IntCodec | Fp8Codec) or type(v_codec) is not type(codec):
        return False
    if vars(codec) != vars(v_codec):
        return False
    return codec.padded_dim % 8 == 0 and attends_in_place(model, layer, shared, store)


def attend_grouped(
    kernels: ModuleType,
    model: Model,
    layer: int,
    store: QuantisedLayer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """The decode query q [Hq, 1, D] over the layer's stored rows and the new row k, v
    [Hkv, 1, D] (stored by the caller after the step) → [1, q_dim]."""
    cfg = model.config
    codec: IntCodec | Fp8Codec = store.layout.k_codec  # type: ignore[assignment]
    rows, codes = rows_in_place(store, k, v)
    rotation = rotation_matrix(codec.coded_dim, torch.float32, q.device) if codec.rotate else _NONE
    ran(FUSED_PIECES)
    out = kernels.grouped_attention(
        q[:, 0],
        rotation,
        codes,
        store.kv_heads,
        codec.bits,
        isinstance(codec, Fp8Codec),
        codec.group,
        codec.padded_dim,
        rows,
        cfg.attn_scale,
    )  # [Hq, D]
    return out.view(1, cfg.q_dim_of(layer))


_NONE = torch.empty(0)
