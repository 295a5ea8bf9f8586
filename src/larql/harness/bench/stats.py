"""Summary statistics of step timings (nearest-rank percentiles: the sample at index
floor(n·p/100) of the sorted samples)."""

from __future__ import annotations

import math
from dataclasses import dataclass


def nearest_rank(samples: list[float], percentile: float) -> float:
    """The sample at index floor(n·p/100) of the sorted samples (clamped to the last one)."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    return ordered[min(int(len(ordered) * percentile / 100), len(ordered) - 1)]


@dataclass(frozen=True)
class StepStats:
    mean: float
    p50: float
    p99: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> StepStats:
        mean = sum(samples) / len(samples) if samples else math.nan
        return cls(mean, nearest_rank(samples, 50), nearest_rank(samples, 99), len(samples))

    def as_dict(self) -> dict[str, float | int]:
        return {"mean": self.mean, "p50": self.p50, "p99": self.p99, "n": self.n}
