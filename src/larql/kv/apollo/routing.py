"""Which windows of the store a query is about: an inverted index over the windows' token ids,
scored with a BM25-style idf and no length normalisation.

For N windows and a query token that occurs in df of them,

    idf = ln((N − df + 0.5) / (df + 0.5) + 1)

and every window holding the token tf times gains tf × idf. A token present in every window
(df ≥ N) says nothing and is skipped. Each query position counts, so a token repeated in the
query adds its score once per occurrence.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np


def idf(num_windows: int, df: int) -> float:
    return math.log((num_windows - df + 0.5) / (df + 0.5) + 1.0)


class WindowRouter:
    """token id → [(window, tf)], built once from the windows' token lists."""

    def __init__(self, window_tokens: Sequence[Iterable[int] | np.ndarray]) -> None:
        self.num_windows = len(window_tokens)
        self.postings: dict[int, list[tuple[int, int]]] = {}
        for window, tokens in enumerate(window_tokens):
            counts = Counter(int(t) for t in tokens)
            for token, tf in sorted(counts.items()):
                self.postings.setdefault(token, []).append((window, tf))

    def df(self, token: int) -> int:
        return len(self.postings.get(token, ()))

    def scores(self, query_ids: Sequence[int]) -> dict[int, float]:
        """window → summed tf × idf over the query's tokens (windows that score nothing absent)."""
        n = self.num_windows
        scores: dict[int, float] = {}
        for token in query_ids:
            postings = self.postings.get(int(token))
            if not postings or len(postings) >= n:
                continue
            weight = idf(n, len(postings))
            for window, tf in postings:
                scores[window] = scores.get(window, 0.0) + tf * weight
        return scores

    def resolve(self, query_ids: Sequence[int], k: int) -> list[tuple[int, float]]:
        """The k best (window, score) pairs, best first; ties go to the earlier window."""
        ranked = sorted(self.scores(query_ids).items(), key=lambda ws: (-ws[1], ws[0]))
        return ranked[:k]
