"""The row codecs of `kv-quant`, the plain quantisers users compare turbo-quant against.

`IntCodec`: per-token groups of `group` coordinates, each with its own fp16 scale and fp16
zero point (asymmetric, min–max), codes of 2, 4 or 8 bits packed tightly. `Fp8Codec`: per-group
fp16 scale (absmax / 448), coordinates as float8 e4m3. Either may first rotate the row by the
signed Walsh–Hadamard transform (zero-padded to a power of two), which spreads an outlier
coordinate over the whole row, as llama.cpp does for a quantised K/V cache. One vector is
[scales ; zero points ; codes]; its bytes count every scale and zero point.
"""

from __future__ import annotations

from types import ModuleType

import torch

from larql.kv.turbo_quant.packing import pack_indices, packed_size, unpack_indices
from larql.kv.turbo_quant.rotation import next_power_of_two, rotation_matrix

FP8_MAX = 448.0  # the largest finite float8 e4m3 value
_TINY = 1e-8
_EMPTY = torch.empty(0)  # the extension's "none" for an optional tensor


class _GroupedCodec:
    """What both codecs share: the optional rotation and the split into groups."""

    bits: int
    fp8 = False  # e4m3 codes (Fp8Codec), else integer ones

    def __init__(self, dim: int, group: int, rotate: bool) -> None:
        self.dim, self.rotate = dim, rotate
        self.coded_dim = next_power_of_two(dim) if rotate else dim
        self.group = min(group, self.coded_dim)
        self.groups = -(-self.coded_dim // self.group)
        self.padded_dim = self.groups * self.group

    def compiled_encode(
        self, kernels: ModuleType, rows: torch.Tensor, mean: torch.Tensor | None
    ) -> torch.Tensor:
        """rows [S, 2, Hkv, D] (float32 or float16) minus `mean` [2, Hkv, D] → one code row per
        token, uint8 [S, 2 · Hkv · bytes_per_vector], by the CPU extension (`grouped_encode`):
        the bytes `encode` gives."""
        return kernels.grouped_encode(
            rows,
            _EMPTY if mean is None else mean,
            self._rotation(rows.device),
            self.bits,
            self.group,
            self.padded_dim,
            self.fp8,
        )

    def compiled_codes(self, device: torch.device) -> tuple[object, ...]:
        """The codec as the CPU extension's one-call step takes it (`decode_layers_coded`):
        bits, group, width, rotation (or none), no codebook, no norm correction, fp8 or not."""
        return (
            self.bits,
            self.group,
            self.padded_dim,
            self._rotation(device),
            _EMPTY,
            _EMPTY,
            False,
            self.fp8,
        )

    def _rotation(self, device: torch.device) -> torch.Tensor:
        if not self.rotate:
            return _EMPTY
        return rotation_matrix(self.coded_dim, torch.float32, device)

    def _groups_of(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, dim] → [N, groups, group] float32 (rotated first if asked)."""
        x = torch.nn.functional.pad(x.float(), (0, self.coded_dim - self.dim))
        if self.rotate:
            x = x @ rotation_matrix(self.coded_dim, torch.float32, x.device)
        x = torch.nn.functional.pad(x, (0, self.padded_dim - self.coded_dim))
        return x.view(x.shape[0], self.groups, self.group)

    def _rows_of(self, groups: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N, groups, group] float32 → [N, dim] in `dtype` (rotated back if needed)."""
        x = groups.reshape(groups.shape[0], -1)[:, : self.coded_dim]
        if self.rotate:
            x = x @ rotation_matrix(self.coded_dim, torch.float32, x.device)
        return x[:, : self.dim].to(dtype)


class IntCodec(_GroupedCodec):
    def __init__(self, dim: int, bits: int, group: int = 32, rotate: bool = False) -> None:
        if bits not in (2, 4, 8):
            raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
        super().__init__(dim, group, rotate)
        self.bits = bits
        self.code_bytes = packed_size(self.padded_dim, bits)
        self.bytes_per_vector = 4 * self.groups + self.code_bytes  # fp16 scale + zero per group

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, dim] → uint8 [N, bytes_per_vector]."""
        g = self._groups_of(x)  # [N, G, g]
        low, high = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
        levels = (1 << self.bits) - 1
        scale = ((high - low) / levels).half().float().clamp_min(_TINY)  # as stored
        zero = low.half().float()
        codes = torch.round((g - zero) / scale).clamp(0, levels).to(torch.int64)
        packed = pack_indices(codes.view(g.shape[0], self.padded_dim), self.bits)
        header = torch.cat((scale, zero), dim=1).squeeze(-1).half()  # [N, 2G]
        return torch.cat(
            (header.view(torch.uint8).view(g.shape[0], 4 * self.groups), packed), dim=1
        )

    def decode(self, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 [N, bytes_per_vector] → [N, dim] in `dtype`."""
        n = data.shape[0]
        header = data[:, : 4 * self.groups].contiguous().view(torch.float16).float()
        scale, zero = header[:, : self.groups, None], header[:, self.groups :, None]
        codes = unpack_indices(data[:, 4 * self.groups :], self.padded_dim, self.bits)
        g = codes.view(n, self.groups, self.group).float() * scale + zero
        return self._rows_of(g, dtype)


class Fp8Codec(_GroupedCodec):
    fp8 = True

    def __init__(self, dim: int, group: int = 32, rotate: bool = False) -> None:
        super().__init__(dim, group, rotate)
        self.bits = 8
        self.bytes_per_vector = 2 * self.groups + self.padded_dim  # fp16 scale per group

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        g = self._groups_of(x)  # [N, G, g]
        scale = (g.abs().amax(dim=-1, keepdim=True) / FP8_MAX).half().float().clamp_min(_TINY)
        codes = (
            (g / scale).to(torch.float8_e4m3fn).view(torch.uint8).view(g.shape[0], self.padded_dim)
        )
        header = scale.squeeze(-1).half().view(torch.uint8).view(g.shape[0], 2 * self.groups)
        return torch.cat((header, codes), dim=1)

    def decode(self, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        n = data.shape[0]
        scale = data[:, : 2 * self.groups].contiguous().view(torch.float16).float()
        codes = data[:, 2 * self.groups :].contiguous().view(torch.float8_e4m3fn).float()
        g = codes.view(n, self.groups, self.group) * scale.unsqueeze(-1)
        return self._rows_of(g, dtype)


def triton_codes(codec: object) -> bool:
    """Whether kv-quant's Triton kernels (`kernels`) take these codes: `IntCodec` codes of 2, 4
    or 8 bits whose coded width (the head width, or its power of two when rotated) is a power
    of two ≥ 16, cut into power-of-two groups of at least 2 coordinates with no padding."""
    if not isinstance(codec, IntCodec) or codec.bits not in (2, 4, 8):
        return False
    width, group = codec.coded_dim, codec.group
    return (
        width >= _MIN_KERNEL_WIDTH
        and _power_of_two(width)
        and codec.padded_dim == width
        and group >= 2
        and _power_of_two(group)
    )


_MIN_KERNEL_WIDTH = 16  # tl.dot needs every dimension ≥ 16


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
