"""`KvBuffer`: one layer's K/V rows, oldest first, on `GrowableRows` (amortised O(1) appends;
a sliding layer keeps only its last `keep` rows). Rows are stored [n, Hkv, D] and handed out as
[Hkv, n, D] views, the layout attention takes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from larql.inference.snapshots import StateReader, StateWriter
from larql.kv.rows import GrowableRows


class KvBuffer:
    """K/V rows of one layer. `keep` = rows retained after `clip()` (None = all)."""

    def __init__(self, keep: int | None = None) -> None:
        self.keep = keep
        self._k = GrowableRows(keep)  # rows [n, Hkv, D]
        self._v = GrowableRows(keep)

    def __len__(self) -> int:
        return len(self._k)

    def expect(self, rows: int) -> None:
        """Up to `rows` rows are coming: allocate room for them at once (`GrowableRows.expect`)."""
        self._k.expect(rows)
        self._v.expect(rows)

    @property
    def keys(self) -> torch.Tensor:
        """[Hkv, n, D] view of the live rows."""
        return self._k.rows.transpose(0, 1)

    @property
    def values(self) -> torch.Tensor:
        return self._v.rows.transpose(0, 1)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [Hkv, S, D] → every live row including the new ones, [Hkv, n, D]."""
        keys = self._k.append(k.transpose(0, 1))
        values = self._v.append(v.transpose(0, 1))
        return keys.transpose(0, 1), values.transpose(0, 1)

    def decode_slots(
        self, rows: int = 1, like: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
        """Room for `rows` new rows, written by the caller in place (a compiled decode layer):
        → (K storage, V storage: [capacity, Hkv, D], the first live row, the first new row's
        index); `commit_rows(rows)` then counts them. An empty buffer's storage is made like
        `like` ([1, Hkv, D]); None when it is empty and no `like` is given."""
        keys, values = self._k.reserve_back(rows, like), self._v.reserve_back(rows, like)
        if keys is None or values is None:
            return None
        # (K and V rows are appended together, so their first and next rows agree)
        return keys[0], values[0], keys[1], keys[2]

    def commit_rows(self, rows: int = 1) -> None:
        self._k.commit(rows)
        self._v.commit(rows)

    def copy(self) -> KvBuffer:
        """An independent buffer of the same live rows (copied)."""
        out = KvBuffer(self.keep)
        if len(self):
            out.append(self.keys, self.values)
        return out

    def clip(self) -> None:
        """Drop the oldest rows beyond `keep`."""
        if self.keep is None:  # (every layer of every session's step calls this)
            return
        self._k.clip()
        self._v.clip()

    def truncate(self, n_rows: int) -> None:
        """Keep only the first n_rows live rows (used to roll back speculative appends)."""
        self._k.truncate(n_rows)
        self._v.truncate(n_rows)

    def replace_row(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite live rows index.. with k, v: [Hkv, n, D] (IndexError past the live rows)."""
        self._k.replace(index, k.transpose(0, 1))
        self._v.replace(index, v.transpose(0, 1))

    def nbytes(self) -> int:
        """Bytes allocated (what the process actually holds), not just the live rows."""
        return self._k.nbytes() + self._v.nbytes()

    def write_state(self, state: StateWriter, rows: int | None = None) -> None:
        """Its live rows: `k`, `v` [n, Hkv, D] (nothing where it never held a row); with
        `rows`, only the first that many (the state of a prefix)."""
        keys, values = self._k.live_rows(), self._v.live_rows()
        if rows is not None and keys is not None and values is not None:
            keys, values = keys[:rows], values[:rows]
        state.tensor("k", keys)
        state.tensor("v", values)

    def read_state(
        self, state: StateReader, count: int, dtype: torch.dtype, heads: int, dim: int
    ) -> None:
        """Take back `count` rows of [heads, dim] in `dtype` (what `write_state` wrote)."""
        keys = state.rows("k", dtype, count, (heads, dim))
        values = state.rows("v", dtype, count, (heads, dim))
        self._k = GrowableRows.holding(keys, self.keep)
        self._v = GrowableRows.holding(values, self.keep)

    def live_nbytes(self) -> int:
        return self._k.live_nbytes() + self._v.live_nbytes()


def step_slots(
    buffers: Sequence[object], rows: int = 1
) -> tuple[list[torch.Tensor], list[torch.Tensor], int, int] | None:
    """Room for `rows` new rows in each of one session's layer buffers where they all hold their
    rows at the same places (a step of an engine that appends every row to every layer and
    keeps them all): → (each buffer's K and V storage [capacity, Hkv, D], the first live row,
    the first new row's index), one check per buffer instead of a reservation; `commit_step`
    then counts the rows. Where their storage is full, every buffer grows alike first. None
    where any buffer is not such a `KvBuffer`, or is still empty (reserve them one by one)."""
    slots = _aligned_slots(buffers, rows)
    if slots == "full":  # the same places, no room after them: each grows the same way
        for buffer in buffers:
            buffer.decode_slots(rows)  # type: ignore[attr-defined]
        slots = _aligned_slots(buffers, rows)
    return None if slots == "full" else slots  # type: ignore[return-value]


def _aligned_slots(
    buffers: Sequence[object], rows: int = 1
) -> tuple[list[torch.Tensor], list[torch.Tensor], int, int] | str | None:
    """`step_slots`' answer without growing: "full" where the buffers hold their rows at the
    same places with less than `rows` rows of room after them. (Every step of every session
    asks this of every layer: comprehensions, not a loop of statements.)"""
    if not all(type(b) is KvBuffer and b.keep is None for b in buffers):
        return None
    stores = [b._k for b in buffers] + [b._v for b in buffers]  # type: ignore[attr-defined]
    head = stores[0]
    start, end = head._start, head._end
    if not all(r._start == start and r._end == end and r.capacity for r in stores):
        return None
    if end + rows > min(r.capacity for r in stores):
        return "full"
    data = [r._data for r in stores]
    half = len(buffers)
    return data[:half], data[half:], start, end


def step_rows(
    slots: Sequence[tuple[list[torch.Tensor], list[torch.Tensor], int, int]],
) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], list[int], list[int]]]:
    """Several sessions' `step_slots` (one decode row each) → per layer, what the compiled
    layers take for the step's rows: (each session's K storage, V storage, first live row, the
    slot its new row goes to)."""
    firsts = [slot[2] for slot in slots]
    news = [slot[3] for slot in slots]
    keys = zip(*(slot[0] for slot in slots), strict=True)
    values = zip(*(slot[1] for slot in slots), strict=True)
    return [(k, v, firsts, news) for k, v in zip(keys, values, strict=True)]


def commit_step(buffers: Sequence[KvBuffer], rows: int = 1) -> None:
    """Count the rows each buffer's storage got at its end (after `step_slots`)."""
    for buffer in buffers:
        buffer._k._end += rows
        buffer._v._end += rows
