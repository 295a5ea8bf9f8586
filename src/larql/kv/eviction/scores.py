"""Attention weights as the eviction policies read them: per K/V head, summed (or, for kvzip,
the most) over the query heads that share it (GQA) and over the queries asked."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from larql.models.model import Model

_QUERY_CHUNK = 256  # queries per product when summing over a long prompt


def attention_mass(
    model: Model, q: torch.Tensor, keys: torch.Tensor, first_query: int
) -> torch.Tensor:
    """q: [Hq, S, D] the queries at key rows first_query .. first_query + S − 1 of keys
    [Hkv, T, D] (row i is position i, causal) → Σ over the S queries and the group's query
    heads of the softmax weights: [Hkv, T] float32."""
    out = torch.zeros(keys.shape[0], keys.shape[1], dtype=torch.float32, device=keys.device)
    for _, weights in _weights(model, q, keys, first_query):
        out += weights.sum(dim=(1, 2))
    return out


def attended_with_peak(
    model: Model,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    first_query: int,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [Hq, S, D] the queries at key rows first_query .. first_query + S − 1 of keys, values
    [Hkv, T, D] (row i is position i, causal, no window, no attention sinks) → (the attention
    output [S, Hq·D] in q's dtype, as `layer.attend` gives it; the most any query and any query
    head of the group attends to each of the first `rows` rows, [Hkv, rows] float32). One
    product gives both: the weights the peak reads are those the output sums."""
    heads, s, _ = q.shape
    kv_heads = keys.shape[0]
    v = values.float()
    out = torch.empty(kv_heads, heads // kv_heads, s, v.shape[-1], device=q.device)
    peak = torch.zeros(kv_heads, rows, dtype=torch.float32, device=keys.device)
    for start, weights in _weights(model, q, keys, first_query):  # [Hkv, G, C, T]
        peak = torch.maximum(peak, weights[..., :rows].amax(dim=(1, 2)))
        kv_heads, group, c, t = weights.shape
        summed = torch.bmm(weights.view(kv_heads, group * c, t), v)  # [Hkv, G·C, Dv]
        out[:, :, start : start + c] = summed.view(kv_heads, group, c, -1)
    return out.reshape(heads, s, -1).transpose(0, 1).reshape(s, -1).to(q.dtype), peak


def _weights(
    model: Model, q: torch.Tensor, keys: torch.Tensor, first_query: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """The causal softmax weights of q [Hq, S, D] over keys [Hkv, T, D] (`attention_mass`),
    a chunk of queries at a time → (the chunk's first query, weights [Hkv, G, C, T] float32)."""
    cfg = model.config
    kv_heads, t, dim = keys.shape
    group = q.shape[0] // kv_heads
    grouped = q.reshape(kv_heads, group, q.shape[1], dim).float()  # [Hkv, G, S, D]
    if cfg.arch.attn_softcap is None:  # the scale on the queries: C·D products, not C·T
        grouped = grouped * cfg.attn_scale
    k_t = keys.float().transpose(1, 2)  # [Hkv, D, T]
    # on meta (`larql memory`) nothing is allocated: one product, the same shapes
    step = max(1, q.shape[1]) if keys.device.type == "meta" else _QUERY_CHUNK
    for start in range(0, q.shape[1], step):
        chunk = grouped[:, :, start : start + step]  # [Hkv, G, C, D]
        c = chunk.shape[2]
        scores = torch.bmm(chunk.reshape(kv_heads, group * c, dim), k_t)  # [Hkv, G·C, T]
        scores = scores.view(kv_heads, group, c, t)
        if cfg.arch.attn_softcap is not None:
            cap = cfg.arch.attn_softcap
            scores = cap * torch.tanh(scores * (cfg.attn_scale / cap))
        # query i (key row first + i) sees rows ≤ first + i: only the last C columns hold
        # rows some query of the chunk does not see
        first = first_query + start
        rows = first + torch.arange(c, device=keys.device)
        tail = torch.arange(first + 1, t, device=keys.device)  # [≤ C − 1]
        future = tail[None, :] > rows[:, None]  # [C, ≤ C − 1]
        scores[..., first + 1 :].masked_fill_(future, float("-inf"))
        yield start, torch.softmax(scores, dim=-1)


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [Hkv, T, D], index [Hkv, n] → each head's chosen rows [Hkv, n, D]."""
    return torch.gather(rows, 1, index.unsqueeze(-1).expand(-1, -1, rows.shape[-1]))
