"""Dropping rows from a quantiser's store while decoding (`h2o` or `tova` composed with a
quantiser): the policy names the rows each K/V head keeps, and the store is compacted to them in
its own storage, so the bytes held stay at the budget instead of growing with the generation.

The store keeps its order — [sinks, exact] [codes] [recent, exact] — and row i of each head is
that head's i-th kept row (position order; a query sees every row, the keys carry their rotary
position). The heads keep different rows, but each region holds the same count for every head:
after a drop the sinks are the fewest any head still keeps there, and so are the recent rows. A
head's exact row that no longer falls in its region is coded — from its exact (or int8) copy, as
a row leaving the recent window is — and a stored code is never decoded or coded again. A store
that lost a sink row takes no new ones (its newest rows stay after its codes)."""

from __future__ import annotations

import torch

from larql.kv.turbo_quant.recent import gather_per_head, refill
from larql.kv.turbo_quant.store import QuantisedLayer


def drop_rows(store: QuantisedLayer, index: torch.Tensor) -> None:
    """index [Hkv, m] int64: the rows each K/V head keeps (0..len−1: sinks, then codes, then
    recent rows), ascending; every other row is dropped."""
    m = index.shape[1]
    s, c = len(store.sinks), len(store.codes)
    if m == len(store):
        return
    first_recent = s + c
    if index.is_meta:  # `larql memory` (no values): as if the exact rows stayed, the codes went
        sinks = min(s, m)
        recent = min(len(store.recent), m - sinks)
    else:
        sinks = int((index < s).sum(dim=1).min())  # the sinks every head still keeps
        recent = int((index >= first_recent).sum(dim=1).min())
    by_row = index.T  # [m, Hkv]
    coded = _codes_of(store, by_row[sinks : m - recent], s, first_recent)
    if sinks < s:
        store.sink_room = sinks
    refill(store.sinks, gather_per_head(store.sinks.rows, by_row[:sinks]) if sinks else _none())
    refill(store.codes, coded)
    if recent:
        store.recent.keep_rows(by_row[m - recent :] - first_recent)
    else:
        store.recent.truncate(0)


def _codes_of(
    store: QuantisedLayer, index: torch.Tensor, s: int, first_recent: int
) -> torch.Tensor:
    """index [n, Hkv] (store rows) → their code rows [n, row_bytes]: a code as stored, an
    exact row (a sink or recent row each head no longer keeps exact) coded now."""
    if index.shape[0] == 0:
        return torch.empty(0, store.row_bytes, dtype=torch.uint8)
    pool, start = [], s
    if s and (index.is_meta or bool((index < s).any())):
        pool.append(store.coded(store.sinks.rows))
        start = 0
    if len(store.codes):
        pool.append(store.codes.rows)
    if len(store.recent) and (index.is_meta or bool((index >= first_recent).any())):
        pool.append(store.coded(store.recent.rows))
    return _gather_codes(store, torch.cat(pool), index - start)


def _gather_codes(store: QuantisedLayer, codes: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """codes [P, row_bytes] ([K heads ; V heads]), index [n, Hkv] → [n, row_bytes]: head h's
    vectors of row j are those of code row index[j, h]."""
    heads, p = store.kv_heads, codes.shape[0]
    k_bytes = heads * store.layout.k_codec.bytes_per_vector
    halves = []
    for half in (codes[:, :k_bytes], codes[:, k_bytes:]):
        vectors = half.reshape(p, heads, -1)  # [P, Hkv, bytes_per_vector]
        picked = index[:, :, None].expand(-1, -1, vectors.shape[-1])
        halves.append(torch.gather(vectors, 0, picked).reshape(index.shape[0], -1))
    return torch.cat(halves, dim=1)


def _none() -> torch.Tensor:
    return torch.empty(0)
