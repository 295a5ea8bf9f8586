"""The signed Walsh–Hadamard rotation y = D·H·D·x that spreads a vector's energy evenly over its
coordinates before scalar quantisation.

H is the normalised Sylvester–Hadamard matrix (H[i, j] = (−1)^popcount(i & j) / √d) and D a fixed
diagonal of signs: coordinate i is flipped iff bit 16 of (i × 2654435761) mod 2⁶⁴ is set, a
deterministic hash so encoder and decoder agree without storing anything. H and D are symmetric
and orthogonal, so D·H·D is its own inverse: the same matrix encodes and decodes.
"""

from __future__ import annotations

import math

import torch

_HASH_MULTIPLIER = 2654435761
_HASH_BIT = 16


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def sign_flips(dim: int) -> list[float]:
    """The diagonal of D: −1.0 where the hash of the coordinate index has bit 16 set."""
    mask = (1 << 64) - 1
    return [-1.0 if ((i * _HASH_MULTIPLIER) & mask) >> _HASH_BIT & 1 else 1.0 for i in range(dim)]


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """Normalised fast Walsh–Hadamard transform over the last dim (butterflies (a, b) →
    (a + b, a − b) at half = 1, 2, 4, …, then × 1/√d). x: [..., d] with d a power of two."""
    d = x.shape[-1]
    if not is_power_of_two(d):
        raise ValueError(f"Walsh–Hadamard needs a power-of-two length, got {d}")
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    half = 1
    while half < d:
        pairs = y.view(-1, d // (2 * half), 2, half)  # [N, blocks, (a|b), half]
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, d)
        half *= 2
    return (y / math.sqrt(d)).reshape(*lead, d)


def signed_walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """D·H·D·x by butterflies, x: [..., d]. The reference the matrix form is tested against."""
    signs = torch.tensor(sign_flips(x.shape[-1]), dtype=x.dtype, device=x.device)
    return walsh_hadamard(x * signs) * signs


_MATRICES: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def rotation_matrix(dim: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """The cached [dim, dim] matrix R = D·H·D (symmetric, R·R = I), so a batch of rows rotates
    with one matmul: rows @ R."""
    key = (dim, dtype, torch.device(device))
    matrix = _MATRICES.get(key)
    if matrix is None:
        identity = torch.eye(dim, dtype=torch.float64)
        exact = signed_walsh_hadamard(identity)  # row i = R·e_i = column i of R (R symmetric)
        matrix = _MATRICES[key] = exact.to(dtype=dtype, device=key[2])
    return matrix


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x: [..., d] → D·H·D applied to every row (self-inverse: rotate(rotate(x)) = x)."""
    return x @ rotation_matrix(x.shape[-1], x.dtype, x.device)
