"""Rotary position embedding at absolute positions, one function for prefill, decode and K/V
recompute (a recompute that used other RoPE parameters than the attention block would silently
break the residual engines)."""

from __future__ import annotations

import torch

from larql.models.config import RopeSpec

_MIN_TABLE = 256


class RopeTable:
    """cos/sin of one `RopeSpec` for positions [0, n), grown on demand (doubling)."""

    def __init__(self, spec: RopeSpec, dtype: torch.dtype, device: torch.device) -> None:
        self.spec = spec
        self.dtype = dtype
        self.device = device
        self._inv_freq = spec.inv_freq()  # [rotary_dim/2] float64
        self.cos = torch.empty(0, spec.rotary_dim // 2, dtype=dtype, device=device)
        self.sin = self.cos

    def _grow(self, n: int) -> None:
        size = max(_MIN_TABLE, self.cos.shape[0] * 2)
        while size < n:
            size *= 2
        # angles in float64: positions in the tens of thousands lose phase in float32
        angles = torch.outer(torch.arange(size, dtype=torch.float64), self._inv_freq)
        self.cos = angles.cos().to(self.dtype).to(self.device)
        self.sin = angles.sin().to(self.dtype).to(self.device)

    def slice(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions start..start+length-1, each [length, rotary_dim/2]."""
        end = start + length
        if end > self.cos.shape[0]:
            self._grow(end)
        return self.cos[start:end], self.sin[start:end]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the split-half pairs (x_i, x_{i+half}) of the first `rotary_dim` dims.

    x: [heads, S, head_dim]; cos, sin: [S, rotary_dim/2]. Dims beyond rotary_dim pass through.
    """
    half = cos.shape[-1]
    rotary_dim = 2 * half
    x1 = x[..., :half]
    x2 = x[..., half:rotary_dim]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
