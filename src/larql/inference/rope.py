"""Rotary position embedding at absolute positions, one function for prefill, decode and K/V
recompute (a recompute that used other RoPE parameters than the attention block would silently
break the residual engines).

Length-dependent scalings (`dynamic` NTK, `longrope`) rotate each row at the length of the
sequence as of the call that computes it: a call over positions start..start+S−1 uses length
start+S for all its rows — a prefill rotates the prompt at the prompt's length, a decode step at
position p rotates its q and k at length p+1, and cached keys keep the rotation they were
computed with. That is what transformers computes with its default cache (its rotary module
recomputes the frequencies from the current length on every forward call). An engine that
re-runs the whole sequence every step (`no-cache`) therefore rotates every row at the current
length, as transformers does without a cache; past the scaling's threshold the two differ.
"""

from __future__ import annotations

import torch

from larql.kernels import elementwise_kernels
from larql.models.config import RopeSpec

_MIN_TABLE = 256


class RopeTable:
    """cos and signed sin of one `RopeSpec` for positions [0, n), full rotary width, grown on
    demand (doubling): cos = [cos θ, cos θ]·a, sin = [−sin θ, sin θ]·a (a: the spec's attention
    factor), so that a rotation is x·cos + [x₂, x₁]·sin (three kernels).

    Row p of the table is position p as a one-row call at p rotates it (sequence length p+1),
    which is every row of a length-independent spec; a device-side gather of row p (a captured
    decode step) is therefore right for every spec. A multi-row call past a length-dependent
    spec's threshold gets its rows rotated at its own length instead (`slice`)."""

    def __init__(self, spec: RopeSpec, dtype: torch.dtype, device: torch.device) -> None:
        self.spec = spec
        self.dtype = dtype
        self.device = device
        self.cos = torch.empty(0, spec.rotary_dim, dtype=dtype, device=device)
        self.sin = self.cos
        # the last multi-row slice at its own length (every layer of a forward asks for it)
        self._block: tuple[int, int, torch.Tensor, torch.Tensor] | None = None
        # the last batched step's rows, by positions (every layer of the step asks for them)
        self._rows: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = None

    def _grow(self, n: int) -> None:
        size = max(_MIN_TABLE, self.cos.shape[0] * 2)
        while size < n:
            size *= 2
        positions = torch.arange(size, dtype=torch.float64)  # [size]
        if self.spec.length_dependent:
            angles = positions.unsqueeze(1) * self.spec.inv_freq(positions + 1)
        else:
            angles = torch.outer(positions, self.spec.inv_freq())
        self.cos, self.sin = self._signed(angles)

    def _signed(self, angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """angles: [n, rotary_dim/2] float64 → cos, signed sin: [n, rotary_dim] in the table's
        dtype and device, times the attention factor."""
        # angles in float64: positions in the tens of thousands lose phase in float32
        scale = self.spec.attention_factor
        cos, sin = angles.cos() * scale, angles.sin() * scale  # [n, rotary_dim/2]
        return (
            torch.cat((cos, cos), dim=-1).to(self.dtype).to(self.device),
            torch.cat((-sin, sin), dim=-1).to(self.dtype).to(self.device),
        )

    def slice(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for positions start..start+length-1 of a call over them (a sequence
        of start+length tokens), each [length, rotary_dim]."""
        end = start + length
        spec = self.spec
        if length > 1 and spec.length_dependent and end > spec.original_max_positions:
            return self._at_length(start, end)
        if end > self.cos.shape[0]:
            self._grow(end)
        return self.cos[start:end], self.sin[start:end]

    def rows(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for one-row calls at each of `positions` (the rows of a batched decode
        step, each its own sequence): [len(positions), rotary_dim] each."""
        key = tuple(positions)
        if self._rows is not None and self._rows[0] == key:
            return self._rows[1], self._rows[2]
        if max(positions) >= self.cos.shape[0]:
            self._grow(max(positions) + 1)
        index = torch.tensor(positions, device=self.cos.device)
        self._rows = (key, self.cos[index], self.sin[index])
        return self._rows[1], self._rows[2]

    def _at_length(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions start..end−1, all rotated at sequence length `end`: [end−start, rotary_dim]."""
        if self._block is None or self._block[:2] != (start, end):
            positions = torch.arange(start, end, dtype=torch.float64)  # [S]
            inv_freq = self.spec.inv_freq(torch.tensor([end]))  # [1, rotary_dim/2]
            self._block = (start, end, *self._signed(positions.unsqueeze(1) * inv_freq))
        return self._block[2], self._block[3]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the split-half pairs (x_i, x_{i+half}) of the first `rotary_dim` dims:
    (x₁·cos − x₂·sin, x₂·cos + x₁·sin), computed as x·[cos, cos] + [x₂, x₁]·[−sin, sin].

    x: [heads, S, head_dim]; cos, sin: [S, rotary_dim] from `RopeTable`. Dims beyond rotary_dim
    pass through."""
    if (kernels := elementwise_kernels(x)) is not None:
        return kernels.rope(x, cos, sin)  # one launch on CUDA instead of three
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    if rotary_dim == x.shape[-1]:
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin)
    rot = x[..., :rotary_dim]
    swapped = torch.cat((rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((torch.addcmul(rot * cos, swapped, sin), x[..., rotary_dim:]), dim=-1)
