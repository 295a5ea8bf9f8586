"""Rotary position embedding at absolute positions, one function for prefill, decode and K/V
recompute (a recompute that used other RoPE parameters than the attention block would silently
break the residual engines)."""

from __future__ import annotations

import torch

from larql.models.config import RopeSpec

_MIN_TABLE = 256


class RopeTable:
    """cos and signed sin of one `RopeSpec` for positions [0, n), full rotary width, grown on
    demand (doubling): cos = [cos θ, cos θ], sin = [−sin θ, sin θ], so that a rotation is
    x·cos + [x₂, x₁]·sin (three kernels)."""

    def __init__(self, spec: RopeSpec, dtype: torch.dtype, device: torch.device) -> None:
        self.spec = spec
        self.dtype = dtype
        self.device = device
        self._inv_freq = spec.inv_freq()  # [rotary_dim/2] float64
        self.cos = torch.empty(0, spec.rotary_dim, dtype=dtype, device=device)
        self.sin = self.cos

    def _grow(self, n: int) -> None:
        size = max(_MIN_TABLE, self.cos.shape[0] * 2)
        while size < n:
            size *= 2
        # angles in float64: positions in the tens of thousands lose phase in float32
        angles = torch.outer(torch.arange(size, dtype=torch.float64), self._inv_freq)
        cos, sin = angles.cos(), angles.sin()  # [size, rotary_dim/2]
        self.cos = torch.cat((cos, cos), dim=-1).to(self.dtype).to(self.device)
        self.sin = torch.cat((-sin, sin), dim=-1).to(self.dtype).to(self.device)

    def slice(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for positions start..start+length-1, each [length, rotary_dim]."""
        end = start + length
        if end > self.cos.shape[0]:
            self._grow(end)
        return self.cos[start:end], self.sin[start:end]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the split-half pairs (x_i, x_{i+half}) of the first `rotary_dim` dims:
    (x₁·cos − x₂·sin, x₂·cos + x₁·sin), computed as x·[cos, cos] + [x₂, x₁]·[−sin, sin].

    x: [heads, S, head_dim]; cos, sin: [S, rotary_dim] from `RopeTable`. Dims beyond rotary_dim
    pass through."""
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    if rotary_dim == x.shape[-1]:
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin)
    rot = x[..., :rotary_dim]
    swapped = torch.cat((rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((torch.addcmul(rot * cos, swapped, sin), x[..., rotary_dim:]), dim=-1)
