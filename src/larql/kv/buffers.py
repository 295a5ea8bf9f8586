"""`KvBuffer`: one layer's K/V rows, oldest first, on `GrowableRows` (amortised O(1) appends;
a sliding layer keeps only its last `keep` rows). Rows are stored [n, Hkv, D] and handed out as
[Hkv, n, D] views, the layout attention takes."""

from __future__ import annotations

import torch

from larql.kv.rows import GrowableRows


class KvBuffer:
    """K/V rows of one layer. `keep` = rows retained after `clip()` (None = all)."""

    def __init__(self, keep: int | None = None) -> None:
        self.keep = keep
        self._k = GrowableRows(keep)  # rows [n, Hkv, D]
        self._v = GrowableRows(keep)

    def __len__(self) -> int:
        return len(self._k)

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

    def live_nbytes(self) -> int:
        return self._k.live_nbytes() + self._v.live_nbytes()
