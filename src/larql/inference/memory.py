"""What an engine holds, counted from its tensors: live state by tier (hot, cold, derivative)
and the growth reserve apart, and the one way larql prints byte counts."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from larql.models.model import Model

MIB = 1_048_576  # bytes; every "MiB" larql prints is this binary unit


class Storage(Protocol):
    """Anything an engine keeps state in: bytes allocated, and optionally bytes in use."""

    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes an engine holds right now, counted from its tensors (`numel × element_size`).

    hot: canonical state of the recent rows; cold: canonical state of older rows (any codec);
    derivative: caches that can be rebuilt from the canonical state (e.g. K/V of residuals);
    reserved: capacity allocated ahead by growable buffers and not yet holding rows.
    `total` is everything held; `state` leaves the reserve out (what the rows themselves cost).
    """

    hot: int = 0
    cold: int = 0
    derivative: int = 0
    reserved: int = 0

    @property
    def state(self) -> int:
        return self.hot + self.cold + self.derivative

    @property
    def total(self) -> int:
        return self.state + self.reserved

    @classmethod
    def of(
        cls,
        hot: Iterable[Storage] = (),
        cold: Iterable[Storage] = (),
        derivative: Iterable[Storage] = (),
    ) -> MemoryBreakdown:
        """From storages (`GrowableRows`, `KvBuffer`, …): their live bytes per category, the
        rest of what they allocated as `reserved`."""
        live = [sum(_live(s) for s in group) for group in (hot, cold, derivative)]
        held = sum(s.nbytes() for group in (hot, cold, derivative) for s in group)
        return cls(*live, reserved=held - sum(live))

    def as_json(self) -> dict[str, int]:
        """Every figure by name: the state (and its tiers), the reserve, and what is held."""
        return {
            "state_bytes": self.state,
            "hot_bytes": self.hot,
            "cold_bytes": self.cold,
            "derivative_bytes": self.derivative,
            "reserve_bytes": self.reserved,
            "held_bytes": self.total,
        }

    def describe(self) -> str:
        """Exact bytes: `state 184,320 B (hot …, cold …, derivative …) + reserve … B = … B held`."""
        return (
            f"state {self.state:,} B (hot {self.hot:,}, cold {self.cold:,}, derivative "
            f"{self.derivative:,}) + reserve {self.reserved:,} B = {self.total:,} B held"
        )

    def brief(self) -> str:
        """For one-line summaries: `state 0.18 MiB + reserve 0.57 MiB`."""
        return f"state {mib(self.state)} + reserve {mib(self.reserved)}"

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        return MemoryBreakdown(
            self.hot + other.hot,
            self.cold + other.cold,
            self.derivative + other.derivative,
            self.reserved + other.reserved,
        )


def _live(storage: Storage) -> int:
    live = getattr(storage, "live_nbytes", None)
    return live() if live is not None else storage.nbytes()


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def over_ranks(model: Model, *counts: int) -> tuple[int, ...]:
    """Byte counts of one engine on `model`, summed over the ranks of its tensor-parallel run
    (every rank calls it, in the same order); alone, the counts themselves. A rank holds its
    heads' share, so the sum is the whole run's bytes."""
    return counts if model.shard is None else tuple(model.shard.total(counts))


def mib_value(n_bytes: int) -> float:
    return n_bytes / MIB


def mib(n_bytes: int) -> str:
    """`0.18 MiB` (binary: 1 MiB = 1,048,576 B)."""
    return f"{mib_value(n_bytes):.2f} MiB"
