"""A growable queue of rows `[n, H]` with amortised O(1) appends at the back and pops at the front.

The residual engines keep one per layer for the hot tier (rows leave at the front when they are
evicted) and the cold codecs keep one for their payload (append-only). Rows live in a
preallocated `[capacity, H]` tensor; when the back runs out of room the live rows are compacted to
the front if that frees enough space, otherwise the tensor grows geometrically — so no single
step copies the whole queue, and the copies that do happen are paid for by the appends before.
"""

from __future__ import annotations

import torch

_MIN_SLACK = 16
_GROWTH = 1.25


class RowBuffer:
    """Rows of one dtype, oldest first."""

    def __init__(self) -> None:
        self._data: torch.Tensor | None = None  # [capacity, H]
        self._start = 0  # first live row
        self._end = 0  # one past the last live row

    def __len__(self) -> int:
        return self._end - self._start

    @property
    def rows(self) -> torch.Tensor:
        """[n, H] view of the live rows (valid until the next `append`)."""
        if self._data is None:
            raise ValueError("empty RowBuffer has no row width yet")
        return self._data[self._start : self._end]

    def append(self, rows: torch.Tensor) -> None:
        """rows: [S, H], copied in."""
        s = rows.shape[0]
        self._reserve(s, rows)
        assert self._data is not None
        self._data[self._end : self._end + s] = rows
        self._end += s

    def pop_front(self, n: int) -> torch.Tensor:
        """Remove the n oldest rows and return them as a fresh tensor [n, H]."""
        if n > len(self):
            raise ValueError(f"cannot pop {n} rows from {len(self)}")
        assert self._data is not None
        popped = self._data[self._start : self._start + n].clone()
        self._start += n
        # A queue left far larger than it now is (after a long prefill) is shrunk once.
        target = len(self) + _slack(len(self))
        if self._data.shape[0] > 2 * target:
            self._reallocate(target, self._data)
        return popped

    def nbytes(self) -> int:
        """Bytes allocated (what the process actually holds), not just the live rows."""
        return 0 if self._data is None else self._data.numel() * self._data.element_size()

    def _reserve(self, s: int, like: torch.Tensor) -> None:
        if self._data is None:
            self._data = like.new_empty(s + _slack(s), *like.shape[1:])
            self._start = self._end = 0
            return
        capacity = self._data.shape[0]
        if self._end + s <= capacity:
            return
        needed = len(self) + s
        if needed + _slack(needed) <= capacity:
            self._compact()
        else:
            self._reallocate(max(needed + _slack(needed), int(capacity * _GROWTH)), like)

    def _compact(self) -> None:
        assert self._data is not None
        live = len(self)
        self._data[:live] = self._data[self._start : self._end].clone()
        self._start, self._end = 0, live

    def _reallocate(self, capacity: int, like: torch.Tensor) -> None:
        old = self.rows
        live = len(self)
        self._data = like.new_empty(capacity, *like.shape[1:])
        self._data[:live] = old
        self._start, self._end = 0, live


def _slack(n: int) -> int:
    return max(_MIN_SLACK, n // 4)
