"""turbo-quant's decode attention on the CPU over a layer's 4-bit codes in place.

The torch path decodes every stored row back to floats each step (centroids × norm, plus the
mean with centering) and concatenates them with the exact rows: ~4 copies of the history a layer
and step. Here the extension's `coded_attention` reads the codes as stored and returns the
softmax state of the coded rows (running maximum m, sum l, weighted values acc, in the codec's
rotated basis); the few exact rows (sinks, recent, the new row) are scored in torch and merged:

    out = (e^{m − M} · acc + Σ_e e^{s_e − M} v_e) / (e^{m − M} · l + Σ_e e^{s_e − M}),
    M = max(m, max_e s_e)

The same attention as the torch path's up to float rounding. Used where it applies: a float32
model on the CPU with the extension built, a full-attention layer without soft caps or attention
sinks and whose K/V no other layer shares, the rotated basis, 4-bit codes of one codec for K
and V, and at least one coded row; everything else keeps the torch path.
"""

from __future__ import annotations

from types import ModuleType

import torch

from larql.inference.layer import effective_window
from larql.inference.linear import load_block_kernels
from larql.inference.shared_kv import SharedKv
from larql.kv.turbo_quant.codebook import codebook
from larql.kv.turbo_quant.codec import TurboQuantCodec
from larql.kv.turbo_quant.store import QuantisedLayer, rotate
from larql.models.model import Model


def coded_kernels(
    model: Model, layer: int, store: QuantisedLayer, rotation: torch.Tensor | None,
    shared: SharedKv,
) -> ModuleType | None:  # fmt: skip
    """The extension where this layer's step can attend over its codes in place, else None."""
    codec = store.layout.k_codec
    if rotation is None or model.device.type != "cpu" or model.dtype != torch.float32:
        return None
    if not isinstance(codec, TurboQuantCodec) or codec.bits != 4:
        return None
    if store.layout.v_codec is not codec or not len(store.codes) or shared.is_source(layer):
        return None
    cfg = model.config
    if cfg.arch.attn_softcap is not None or model.weights.layers[layer].attn_sinks is not None:
        return None
    if effective_window(model, layer, None) is not None:
        return None
    kernels = load_block_kernels()
    return kernels if kernels is not None and hasattr(kernels, "coded_attention") else None


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
    kv_heads, heads = store.kv_heads, q.shape[0]
    group, scale = heads // kv_heads, cfg.attn_scale
    queries = rotate(q[:, 0], rotation).contiguous()  # [Hq, D'] float32
    grouped = queries.view(kv_heads, group, -1)  # [Hkv, G, D']
    mean = None if store.mean is None else rotate(store.mean, rotation)  # [2, Hkv, D']
    if mean is None:
        shift = torch.zeros(heads)
    else:
        shift = scale * (grouped * mean[0].unsqueeze(1)).sum(-1).reshape(heads)  # q·μ_K
    centroids = codebook(codec.rotated_dim, 4).centroids
    m, l_sum, acc = kernels.coded_attention(
        queries, store.codes.rows.contiguous(), kv_heads, centroids, shift, scale
    )  # [Hq], [Hq], [Hq, D']
    if mean is not None:
        acc = acc + l_sum.unsqueeze(1) * mean[1].repeat_interleave(group, dim=0)
    keys, values = store.exact_keys_values(torch.float32, rotation)  # [Hkv, E, D']
    keys = torch.cat((keys, rotate(k, rotation)), dim=1)  # + the new row: [Hkv, E + 1, D']
    values = torch.cat((values, rotate(v, rotation)), dim=1)
    scores = (grouped @ keys.transpose(1, 2)).mul_(scale)  # [Hkv, G, E + 1]
    top = torch.maximum(m, scores.amax(-1).reshape(heads))  # [Hq]
    coded = torch.exp(m - top)  # [Hq]
    weights = torch.exp(scores - top.view(kv_heads, group, 1))  # [Hkv, G, E + 1]
    total = coded * l_sum + weights.sum(-1).reshape(heads)
    out = coded.unsqueeze(1) * acc + (weights @ values).reshape(heads, -1)  # [Hq, D']
    back = (out / total.unsqueeze(1)) @ rotation  # [Hq, D'] (R·R = I)
    return back[:, : cfg.head_dim_of(layer)].reshape(1, cfg.q_dim_of(layer))
