"""Lloyd–Max codebooks for the coordinates of a rotated unit vector (docs/DESIGN.md, decision 5).

After an orthogonal rotation that mixes all coordinates, each coordinate of a unit vector of
dimension d is close to N(0, 1/d). The MSE-optimal scalar quantiser for that distribution is the
standard-normal Lloyd–Max quantiser scaled by 1/√d. We fit the standard-normal one analytically
(boundaries = midpoints of centroids, centroids = conditional means over exact Gaussian
integrals) so the tables are deterministic and need no random samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from itertools import pairwise

import torch

SUPPORTED_BITS = (2, 3, 4)
_TOLERANCE = 1e-13
_MAX_ITERATIONS = 100_000


def _pdf(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _conditional_mean(lo: float, hi: float) -> float:
    """E[X | lo < X < hi] for X ~ N(0, 1); lo/hi may be ±inf."""
    mass = _cdf(hi) - _cdf(lo)
    pdf_lo = 0.0 if math.isinf(lo) else _pdf(lo)
    pdf_hi = 0.0 if math.isinf(hi) else _pdf(hi)
    return (pdf_lo - pdf_hi) / mass


@cache
def standard_normal_lloyd_max(bits: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(centroids, inner boundaries) of the 2^bits-level Lloyd–Max quantiser for N(0, 1),
    ascending; len(boundaries) = len(centroids) − 1."""
    if bits < 1:
        raise ValueError(f"bits must be ≥ 1, got {bits}")
    levels = 1 << bits
    # Start at the quantiles of equal-mass cells; Lloyd iterations converge from there.
    centroids = [_normal_quantile((i + 0.5) / levels) for i in range(levels)]
    for _ in range(_MAX_ITERATIONS):
        boundaries = [0.5 * (a + b) for a, b in pairwise(centroids)]
        edges = [-math.inf, *boundaries, math.inf]
        updated = [_conditional_mean(lo, hi) for lo, hi in pairwise(edges)]
        moved = max(abs(a - b) for a, b in zip(updated, centroids, strict=True))
        centroids = updated
        if moved < _TOLERANCE:
            break
    # Exact symmetry: average each centroid with its mirror image.
    centroids = [0.5 * (c - m) for c, m in zip(centroids, reversed(centroids), strict=True)]
    boundaries = [0.5 * (a + b) for a, b in pairwise(centroids)]
    return tuple(centroids), tuple(boundaries)


def gaussian_distortion(bits: int) -> float:
    """E[(X − Q(X))²] of the standard-normal Lloyd–Max quantiser. With centroids at the
    conditional means, E[X·Q(X)] = E[Q(X)²], so the error is 1 − Σ p_i·c_i²."""
    centroids, boundaries = standard_normal_lloyd_max(bits)
    edges = [-math.inf, *boundaries, math.inf]
    energy = sum(
        (_cdf(hi) - _cdf(lo)) * c * c
        for c, lo, hi in zip(centroids, edges, edges[1:], strict=False)
    )
    return 1.0 - energy


def _normal_quantile(p: float) -> float:
    """Φ⁻¹(p) by bisection on the exact CDF (only used to seed the iteration)."""
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _cdf(mid) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Codebook:
    """The quantiser for coordinates of a rotated unit vector of dimension `dim`."""

    dim: int
    bits: int
    centroids: torch.Tensor  # [2^bits] float32, ascending
    boundaries: torch.Tensor  # [2^bits − 1] float32, ascending

    def quantise(self, y: torch.Tensor) -> torch.Tensor:
        """y: [..., dim] float32 → indices [..., dim] uint8: the number of boundaries ≤ y."""
        return torch.bucketize(y, self.boundaries, right=True).to(torch.uint8)

    def dequantise(self, indices: torch.Tensor) -> torch.Tensor:
        """indices: [..., dim] uint8 → centroid values [..., dim] float32."""
        return self.centroids[indices.long()]


_CODEBOOKS: dict[tuple[int, int, torch.device], Codebook] = {}


def codebook(dim: int, bits: int, device: torch.device | str = "cpu") -> Codebook:
    """The cached codebook for N(0, 1/dim) at `bits` bits on `device`."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if dim < 1:
        raise ValueError(f"dim must be ≥ 1, got {dim}")
    key = (dim, bits, torch.device(device))
    book = _CODEBOOKS.get(key)
    if book is None:
        centroids, boundaries = standard_normal_lloyd_max(bits)
        scale = 1.0 / math.sqrt(dim)
        book = _CODEBOOKS[key] = Codebook(
            dim=dim,
            bits=bits,
            centroids=torch.tensor(centroids, dtype=torch.float64, device=key[2])
            .mul(scale)
            .float(),
            boundaries=torch.tensor(boundaries, dtype=torch.float64, device=key[2])
            .mul(scale)
            .float(),
        )
    return book
