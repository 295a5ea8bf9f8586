"""Append-only storage of fixed-size encoded rows: one growable uint8 tensor per layer.

Rows live in a preallocated [capacity, row_bytes] uint8 tensor that grows geometrically, so an
append copies only the new row (amortised O(1)). A store that only keeps its last `keep` rows
(a sliding-window layer: older keys can never be attended again) compacts them to the front when
it runs out of room.
"""

from __future__ import annotations

import torch

_MIN_SLACK = 16
_GROWTH = 1.25


class EncodedRows:
    """Encoded rows of one layer, oldest first; `keep` = rows retained (None = all)."""

    def __init__(self, row_bytes: int, keep: int | None = None) -> None:
        if row_bytes < 1:
            raise ValueError(f"row_bytes must be ≥ 1, got {row_bytes}")
        if keep is not None and keep < 0:
            raise ValueError(f"keep must be ≥ 0, got {keep}")
        self.row_bytes = row_bytes
        self.keep = keep
        self._data: torch.Tensor | None = None  # [capacity, row_bytes] uint8
        self._start = 0  # first live row
        self._end = 0  # one past the last live row

    def __len__(self) -> int:
        return self._end - self._start

    @property
    def rows(self) -> torch.Tensor:
        """[n, row_bytes] uint8 view of the live rows."""
        if self._data is None:
            raise ValueError("no rows stored yet")
        return self._data[self._start : self._end]

    def append(self, rows: torch.Tensor) -> None:
        """rows: [S, row_bytes] uint8; afterwards only the last `keep` rows stay live."""
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != self.row_bytes:
            raise ValueError(f"expected uint8 [S, {self.row_bytes}], got {rows.dtype} {rows.shape}")
        if self.keep is not None and rows.shape[0] > self.keep:
            rows = rows[rows.shape[0] - self.keep :]
        s = rows.shape[0]
        self._reserve(s, rows.device)
        assert self._data is not None
        self._data[self._end : self._end + s] = rows
        self._end += s
        if self.keep is not None and len(self) > self.keep:
            self._start = self._end - self.keep

    def stored_bytes(self) -> int:
        """Bytes of the live rows: what the codec produced and the engine still needs."""
        return len(self) * self.row_bytes

    def allocated_bytes(self) -> int:
        """Bytes of the backing tensor, spare capacity included."""
        return 0 if self._data is None else self._data.numel()

    def _reserve(self, s: int, device: torch.device) -> None:
        if self._data is None:
            self._allocate(s + self._slack(s), device)
            return
        capacity = self._data.shape[0]
        if self._end + s <= capacity:
            return
        needed = len(self) + s
        if self.keep is not None and needed + self._slack(self.keep) <= capacity:
            self._move_live_rows(self._data)
            return
        old = self._data
        self._allocate(max(needed + self._slack(needed), int(capacity * _GROWTH)), device)
        self._move_live_rows(old)

    def _slack(self, n: int) -> int:
        return max(_MIN_SLACK, n // 4)

    def _allocate(self, capacity: int, device: torch.device) -> None:
        self._data = torch.empty(capacity, self.row_bytes, dtype=torch.uint8, device=device)

    def _move_live_rows(self, source: torch.Tensor) -> None:
        """Copy the live rows of `source` to the front of the current tensor."""
        assert self._data is not None
        live = source[self._start : self._end].clone()
        self._data[: live.shape[0]] = live
        self._start, self._end = 0, live.shape[0]
