"""Which stored entries to inject for a query, given the windows routing picked
(`retrieve_entries`).

Seeds are the candidate windows' entries whose token occurs in the query: they anchor the
retrieval. Around them, with each entry scored by its stored coefficient:

- no seed at all          → the top_k entries of the candidate windows by coefficient;
- a seed                  → coefficient;
- within ±10 positions of a seed, same window (not itself a seed) → coefficient × 1.3;
- sharing a seed's fact_id (not itself a seed)                     → coefficient × 1.3;
- still fewer than top_k  → the remaining entries by coefficient, × 0.8 (backfill);

then sort by score and keep top_k. Ties keep store order, so the result is deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

PROXIMITY = 10
NEIGHBOUR_BOOST = 1.3
BACKFILL_DISCOUNT = 0.8


@dataclass(frozen=True)
class ScoredEntry:
    index: int  # row in the store's entries array
    token_id: int
    coefficient: float
    score: float


def retrieve_entries(
    entries: np.ndarray,
    query_ids: Iterable[int],
    candidate_windows: Sequence[int],
    top_k: int,
) -> list[ScoredEntry]:
    """entries: structured array of the store's `ENTRY_DTYPE` → at most top_k scored entries of
    the candidate windows, best first."""
    query = {int(t) for t in query_ids}
    in_candidates = np.isin(entries["window_id"], np.asarray(candidate_windows, dtype=np.int64))
    rows = [int(i) for i in np.flatnonzero(in_candidates)]
    coefficient = {i: float(entries["coefficient"][i]) for i in rows}
    by_coefficient = sorted(rows, key=lambda i: (-coefficient[i], i))
    seeds = [i for i in rows if int(entries["token_id"][i]) in query]
    if not seeds:
        return [_scored(entries, i, coefficient[i]) for i in by_coefficient[:top_k]]

    scores = {i: coefficient[i] for i in seeds}
    seed_facts = {int(entries["fact_id"][i]) for i in seeds}
    seed_spots = {
        (int(entries["window_id"][i]), int(entries["position_in_window"][i])) for i in seeds
    }
    for i in rows:
        if i in scores:
            continue
        window, position = int(entries["window_id"][i]), int(entries["position_in_window"][i])
        near = any(w == window and abs(p - position) <= PROXIMITY for w, p in seed_spots)
        if near or int(entries["fact_id"][i]) in seed_facts:
            scores[i] = coefficient[i] * NEIGHBOUR_BOOST
    for i in by_coefficient:
        if len(scores) >= top_k:
            break
        if i not in scores:
            scores[i] = coefficient[i] * BACKFILL_DISCOUNT
    ranked = sorted(scores, key=lambda i: (-scores[i], i))[:top_k]
    return [_scored(entries, i, scores[i]) for i in ranked]


def _scored(entries: np.ndarray, i: int, score: float) -> ScoredEntry:
    return ScoredEntry(
        index=i,
        token_id=int(entries["token_id"][i]),
        coefficient=float(entries["coefficient"][i]),
        score=score,
    )
