"""`GrowableRows`: rows of one shape and dtype, oldest first, with amortised O(1) appends at the
back and drops at the front — the one storage every engine's per-layer state is built on (K/V,
residuals, encoded rows).

Rows live in a preallocated [capacity, *row_shape] tensor. When the back runs out of room the
live rows are compacted to the front if that frees at least a slack's worth of rows, else the
tensor grows geometrically (×1.25, at least 16 rows of slack); a store left far larger than its
live rows (after a long prefill followed by a window clip) is shrunk once. So no step copies the
whole store, and the copies that do happen are paid for by the appends before them. `nbytes()`
is what is allocated — what the process actually holds. An owner that knows how many rows a
store will hold (`expect`: a generation's prompt and token budget) has them allocated at once,
so a short generation never grows its store step by step.
"""

from __future__ import annotations

import torch

_MIN_SLACK = 16
_GROWTH = 1.25


def _slack(n: int) -> int:
    return max(_MIN_SLACK, n // 4)


class GrowableRows:
    """`keep` = rows retained by `clip()` (None = all)."""

    def __init__(self, keep: int | None = None) -> None:
        if keep is not None and keep < 0:
            raise ValueError(f"keep must be ≥ 0, got {keep}")
        self.keep = keep
        self._data: torch.Tensor | None = None  # [capacity, *row_shape]
        self.capacity = 0  # rows allocated: _data's first dimension
        self._start = 0  # first live row
        self._end = 0  # one past the last live row
        self._expected = 0  # rows the owner expects to hold at most (`expect`)

    def __len__(self) -> int:
        return self._end - self._start

    def expect(self, rows: int) -> None:
        """The owner expects to hold up to `rows` rows: the next allocation (the first, or a
        growth short of them) makes room for them all, not just for the slack after the live
        rows. A store with `keep` holds at most that many, and ignores this."""
        if self.keep is None:
            self._expected = max(rows, 0)

    def live_rows(self) -> torch.Tensor | None:
        """The live rows [n, *row_shape], or None where nothing was ever stored (what a saved
        state keeps: not the spare capacity)."""
        return None if self._data is None else self._data[self._start : self._end]

    @classmethod
    def holding(cls, rows: torch.Tensor | None, keep: int | None = None) -> GrowableRows:
        """A store whose live rows are `rows` [n, *row_shape] (None: empty), taken as its
        storage without a copy."""
        store = cls(keep)
        if rows is not None:
            store._data, store._end = rows, rows.shape[0]
            store.capacity = rows.shape[0]
        return store

    @property
    def rows(self) -> torch.Tensor:
        """[n, *row_shape] view of the live rows (valid until the next append)."""
        if self._data is None:
            raise ValueError("no rows stored yet")
        return self._data[self._start : self._end]

    def append(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [S, *row_shape], copied in → every live row, the new ones last."""
        s = rows.shape[0]
        self._reserve(s, rows)
        assert self._data is not None
        self._data[self._end : self._end + s] = rows
        self._end += s
        return self.rows

    def reserve_back(
        self, s: int, like: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int, int] | None:
        """Room for s more rows without appending them: → (the storage [capacity, *row_shape],
        the first live row's index in it, the index the next row goes to), so a caller can
        write rows there itself and then `commit(s)`. Before the first append the storage is
        made like `like` ([n, *row_shape]: its row shape, dtype and device); None without it."""
        data = self._data
        if data is not None and self._end + s <= self.capacity:  # room already: most steps
            return data, self._start, self._end
        if data is None and like is None:
            return None
        self._reserve(s, data if data is not None else like)  # type: ignore[arg-type]
        assert self._data is not None
        return self._data, self._start, self._end

    def commit(self, s: int) -> None:
        """Count s rows written at the back (after `reserve_back`) as live."""
        assert self._data is not None and self._end + s <= self.capacity
        self._end += s

    def clip(self) -> None:
        """Drop the oldest rows beyond `keep` (no copy; the space is reused on compaction)."""
        if self.keep is not None and len(self) > self.keep:
            self.drop_front(len(self) - self.keep)

    def drop_front(self, n: int) -> None:
        if n > len(self):
            raise ValueError(f"cannot drop {n} rows of {len(self)}")
        self._start += n
        assert self._data is not None
        target = len(self) + _slack(len(self))
        if self.capacity > 2 * target:
            self._reallocate(target, self._data)

    def pop_front(self, n: int) -> torch.Tensor:
        """Remove the n oldest rows and return them as a new tensor [n, *row_shape]."""
        if n > len(self):
            raise ValueError(f"cannot pop {n} rows of {len(self)}")
        popped = self.rows[:n].clone()
        self.drop_front(n)
        return popped

    def truncate(self, n_rows: int) -> None:
        """Keep only the first n_rows live rows (roll back speculative appends)."""
        self._end = self._start + min(n_rows, len(self))

    def replace(self, index: int, rows: torch.Tensor) -> None:
        """Overwrite live rows index.. with rows [n, *row_shape]."""
        n = rows.shape[0]
        if index < 0 or index + n > len(self):
            raise IndexError(f"rows {index}..{index + n - 1} are not all live (0..{len(self) - 1})")
        assert self._data is not None
        self._data[self._start + index : self._start + index + n] = rows

    def nbytes(self) -> int:
        """Bytes allocated, spare capacity included."""
        return 0 if self._data is None else self._data.numel() * self._data.element_size()

    def live_nbytes(self) -> int:
        if self._data is None:
            return 0
        return len(self) * self._data[0].numel() * self._data.element_size()

    def _reserve(self, s: int, like: torch.Tensor) -> None:
        if self._data is None:
            self._data = like.new_empty(max(s + _slack(s), self._expected), *like.shape[1:])
            self.capacity = self._data.shape[0]
            self._start = self._end = 0
            return
        capacity = self.capacity
        if self._end + s <= capacity:
            return
        live = len(self)
        if live + max(s, _slack(live)) <= capacity:
            self._compact()
        else:
            needed = live + s
            grown = max(needed + _slack(needed), int(capacity * _GROWTH), self._expected)
            self._reallocate(grown, like)

    def _compact(self) -> None:
        assert self._data is not None
        live = len(self)
        self._data[:live] = self._data[self._start : self._end].clone()
        self._start, self._end = 0, live

    def _reallocate(self, capacity: int, like: torch.Tensor) -> None:
        live_rows = self.rows
        live = len(self)
        self._data = like.new_empty(capacity, *like.shape[1:])
        self.capacity = capacity
        self._data[:live] = live_rows
        self._start, self._end = 0, live
