"""The cold state of `windowed-checkpoint`: one K/V row per layer for every closed window (the
checkpoint the next window is seeded with) and the token ids of every window (so a closed window
can be replayed), plus the compression figures they buy over a full fp16 K/V cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from larql.inference.memory import tensor_bytes

ARCHIVED_ID_BYTES = 4  # token ids are archived as int32


@dataclass(frozen=True)
class Checkpoint:
    """The K/V of a window's last token on every layer, at its true absolute position."""

    position: int
    keys: tuple[torch.Tensor, ...]  # per layer [Hkv, 1, D]
    values: tuple[torch.Tensor, ...]

    def nbytes(self) -> int:
        return tensor_bytes(*self.keys, *self.values)


class CheckpointStore:
    """window id → `Checkpoint` of that (closed) window."""

    def __init__(self) -> None:
        self._by_window: dict[int, Checkpoint] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._by_window)

    def __contains__(self, window_id: int) -> bool:
        return window_id in self._by_window

    def put(self, window_id: int, checkpoint: Checkpoint) -> None:
        old = self._by_window.get(window_id)
        self._bytes += checkpoint.nbytes() - (old.nbytes() if old else 0)
        self._by_window[window_id] = checkpoint

    def get(self, window_id: int) -> Checkpoint | None:
        return self._by_window.get(window_id)

    def nbytes(self) -> int:
        return self._bytes


@dataclass(frozen=True)
class ArchivedWindow:
    offset: int  # absolute position of the window's first token
    token_ids: torch.Tensor  # [n] int32

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


class TokenArchive:
    """window id → the window's token ids and absolute offset. Closed windows hold an int32
    tensor; the open window's ids are collected in a list until it closes (`pending`), and are
    counted at the same 4 bytes per token."""

    def __init__(self) -> None:
        self._closed: dict[int, ArchivedWindow] = {}
        self._closed_tokens = 0
        self.pending: list[int] = []

    def __len__(self) -> int:
        """Closed windows archived."""
        return len(self._closed)

    @property
    def total_tokens(self) -> int:
        return self._closed_tokens + len(self.pending)

    def close(self, window_id: int, offset: int, device: torch.device) -> ArchivedWindow:
        window = ArchivedWindow(
            offset, torch.tensor(self.pending, dtype=torch.int32, device=device)
        )
        self._closed[window_id] = window
        self._closed_tokens += len(window)
        self.pending = []
        return window

    def get(self, window_id: int) -> ArchivedWindow | None:
        return self._closed.get(window_id)

    def nbytes(self) -> int:
        return ARCHIVED_ID_BYTES * self.total_tokens


@dataclass(frozen=True)
class WindowedCheckpointStats:
    """What the cold state costs against a full fp16 K/V cache of the same tokens."""

    windows: int  # closed windows
    tokens: int  # tokens processed
    equivalent_kv_bytes: int  # tokens × Σ_layers kv_dim × 2 (K, V) × 2 (fp16)
    checkpoint_bytes: int
    archive_bytes: int

    @property
    def boundary_bytes(self) -> int:
        return self.checkpoint_bytes + self.archive_bytes

    @property
    def compression_ratio(self) -> float:
        """0.0 while nothing is stored (no ratio where nothing was measured)."""
        if self.boundary_bytes == 0:
            return 0.0
        return self.equivalent_kv_bytes / self.boundary_bytes

    def summary(self) -> str:
        return (
            f"{self.windows} windows / {self.tokens} tokens — "
            f"{self.compression_ratio:.0f}× compression vs full KV"
        )
