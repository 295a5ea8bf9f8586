"""Growable per-layer K/V storage with amortised O(1) appends.

Rows live in a preallocated [Hkv, capacity, D] tensor; a full buffer grows geometrically, and a
buffer that only keeps its last `keep` rows compacts them to the front when it runs out of room,
so no step copies the whole cache.
"""

from __future__ import annotations

import torch

_MIN_SLACK = 16
_GROWTH = 1.25


class KvBuffer:
    """K/V rows of one layer, oldest first. `keep` = rows retained after `clip()` (None = all)."""

    def __init__(self, keep: int | None = None) -> None:
        if keep is not None and keep < 0:
            raise ValueError(f"keep must be ≥ 0, got {keep}")
        self.keep = keep
        self._k: torch.Tensor | None = None  # [Hkv, capacity, D]
        self._v: torch.Tensor | None = None
        self._start = 0  # first live row
        self._end = 0  # one past the last live row

    def __len__(self) -> int:
        return self._end - self._start

    @property
    def keys(self) -> torch.Tensor:
        """[Hkv, n, D] view of the live rows."""
        assert self._k is not None
        return self._k[:, self._start : self._end]

    @property
    def values(self) -> torch.Tensor:
        assert self._v is not None
        return self._v[:, self._start : self._end]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [Hkv, S, D] → every live row including the new ones, [Hkv, n, D]."""
        s = k.shape[1]
        self._reserve(s, k)
        assert self._k is not None and self._v is not None
        self._k[:, self._end : self._end + s] = k
        self._v[:, self._end : self._end + s] = v
        self._end += s
        return self.keys, self.values

    def clip(self) -> None:
        """Drop the oldest rows beyond `keep` (no copy; the space is reused on compaction).
        A buffer left far larger than `keep` (after a long prefill) is shrunk once."""
        if self.keep is None or len(self) <= self.keep:
            return
        self._start = self._end - self.keep
        assert self._k is not None
        target = self.keep + self._slack(self.keep)
        if self._k.shape[1] > 2 * target:
            self._grow(target, self._k)

    def truncate(self, n_rows: int) -> None:
        """Keep only the first n_rows live rows (used to roll back speculative appends)."""
        self._end = self._start + min(n_rows, len(self))

    def replace_row(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite live rows `index`.. with k, v: [Hkv, n, D] (n = 1 for one row)."""
        assert self._k is not None and self._v is not None
        n = k.shape[1]
        if index < 0 or index + n > len(self):
            raise IndexError(f"rows {index}..{index + n} outside the {len(self)} live rows")
        row = self._start + index
        self._k[:, row : row + n] = k
        self._v[:, row : row + n] = v

    def nbytes(self) -> int:
        """Bytes allocated (what the process actually holds), not just the live rows."""
        if self._k is None or self._v is None:
            return 0
        return 2 * self._k.numel() * self._k.element_size()

    def live_nbytes(self) -> int:
        if self._k is None:
            return 0
        heads, _, dim = self._k.shape
        return 2 * heads * len(self) * dim * self._k.element_size()

    def _reserve(self, s: int, like: torch.Tensor) -> None:
        if self._k is None:
            self._allocate(s + self._slack(s), like)
            return
        capacity = self._k.shape[1]
        if self._end + s <= capacity:
            return
        live = len(self)
        needed = live + s
        # compacting is worth it when it frees at least a slack's worth of rows (amortised O(1))
        if self.keep is not None and live + max(s, self._slack(self.keep)) <= capacity:
            self._compact()
            return
        self._grow(max(needed + self._slack(needed), int(capacity * _GROWTH)), like)

    def _slack(self, n: int) -> int:
        return max(_MIN_SLACK, n // 4)

    def _allocate(self, capacity: int, like: torch.Tensor) -> None:
        heads, _, dim = like.shape
        self._k = like.new_empty(heads, capacity, dim)
        self._v = like.new_empty(heads, capacity, dim)
        self._start = self._end = 0

    def _compact(self) -> None:
        assert self._k is not None and self._v is not None
        live = len(self)
        self._k[:, :live] = self._k[:, self._start : self._end].clone()
        self._v[:, :live] = self._v[:, self._start : self._end].clone()
        self._start, self._end = 0, live

    def _grow(self, capacity: int, like: torch.Tensor) -> None:
        old_k, old_v = self.keys, self.values
        live = len(self)
        self._allocate(capacity, like)
        assert self._k is not None and self._v is not None
        self._k[:, :live] = old_k
        self._v[:, :live] = old_v
        self._end = live
