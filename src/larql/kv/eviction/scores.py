"""Attention weights as the eviction policies read them: per K/V head, summed over the query
heads that share it (GQA) and over the queries asked."""

from __future__ import annotations

import torch

from larql.models.model import Model

_QUERY_CHUNK = 256  # queries per product when summing over a long prompt


def attention_mass(
    model: Model, q: torch.Tensor, keys: torch.Tensor, first_query: int
) -> torch.Tensor:
    """q: [Hq, S, D] the queries at key rows first_query .. first_query + S − 1 of keys
    [Hkv, T, D] (row i is position i, causal) → Σ over the S queries and the group's query
    heads of the softmax weights: [Hkv, T] float32."""
    return _attention_reduced(model, q, keys, first_query, peak=False)


def attention_peak(
    model: Model, q: torch.Tensor, keys: torch.Tensor, first_query: int
) -> torch.Tensor:
    """`attention_mass` with the max over the queries and the group's heads instead of the
    sum: the most any of them attends to each row [Hkv, T] float32."""
    return _attention_reduced(model, q, keys, first_query, peak=True)


def _attention_reduced(
    model: Model, q: torch.Tensor, keys: torch.Tensor, first_query: int, peak: bool
) -> torch.Tensor:
    cfg = model.config
    kv_heads, t, dim = keys.shape
    group = q.shape[0] // kv_heads
    grouped = q.reshape(kv_heads, group, q.shape[1], dim).float()  # [Hkv, G, S, D]
    k = keys.float()
    out = torch.zeros(kv_heads, t, dtype=torch.float32, device=keys.device)
    # on meta (`larql memory`) nothing is allocated: one product, the same [Hkv, T] out
    step = max(1, q.shape[1]) if keys.device.type == "meta" else _QUERY_CHUNK
    for start in range(0, q.shape[1], step):
        chunk = grouped[:, :, start : start + step]  # [Hkv, G, C, D]
        scores = torch.einsum("hgcd,htd->hgct", chunk, k) * cfg.attn_scale  # [Hkv, G, C, T]
        if cfg.arch.attn_softcap is not None:
            cap = cfg.arch.attn_softcap
            scores = cap * torch.tanh(scores / cap)
        rows = first_query + start + torch.arange(chunk.shape[2], device=keys.device)
        future = torch.arange(t, device=keys.device)[None, :] > rows[:, None]  # [C, T]
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        if peak:
            out = torch.maximum(out, weights.amax(dim=(1, 2)))
        else:
            out += weights.sum(dim=(1, 2))
    return out


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [Hkv, T, D], index [Hkv, n] → each head's chosen rows [Hkv, n, D]."""
    return torch.gather(rows, 1, index.unsqueeze(-1).expand(-1, -1, rows.shape[-1]))
