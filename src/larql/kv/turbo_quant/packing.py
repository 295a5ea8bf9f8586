"""Tight little-endian bit packing of small quantiser indices.

Indices form one LSB-first bit stream: index j occupies bits bits·j … bits·j + bits − 1. At 4 bits
that is two per byte, the first in the low nibble; at 3 bits each group of 8 indices is a 24-bit
little-endian word in 3 bytes; at 2 bits four per byte. `packed_size = ceil(count·bits/8)`.
Packing and unpacking work on whole tensors at once (groups of 8 indices ↔ `bits` bytes); at 8,
4 and 2 bits, where a byte holds whole indices, by byte shifts alone (the same bytes).
"""

from __future__ import annotations

import torch

_GROUP = 8  # 8 indices of b bits fill exactly b bytes
_WHOLE_BYTE_BITS = (2, 4, 8)  # a byte holds whole indices


def packed_size(count: int, bits: int) -> int:
    """Bytes that `count` indices of `bits` bits occupy."""
    return (count * bits + 7) // 8


def pack_indices(indices: torch.Tensor, bits: int) -> torch.Tensor:
    """indices: [..., count] integers in [0, 2^bits) → uint8 [..., packed_size(count, bits)]."""
    _check_bits(bits)
    *lead, count = indices.shape
    if bits in _WHOLE_BYTE_BITS and count * bits % 8 == 0:
        per_byte = 8 // bits
        parts = indices.to(torch.uint8).view(*lead, count // per_byte, per_byte)
        packed = parts[..., 0].clone()
        for i in range(1, per_byte):
            packed |= parts[..., i] << (bits * i)
        return packed
    groups = -(-count // _GROUP)
    padded = torch.zeros(*lead, groups * _GROUP, dtype=torch.int64, device=indices.device)
    padded[..., :count] = indices
    shifts = torch.arange(_GROUP, device=indices.device) * bits  # [8]
    words = (padded.view(*lead, groups, _GROUP) << shifts).sum(-1)  # [..., groups]
    byte_shifts = torch.arange(bits, device=indices.device) * 8  # [bits]
    packed = (words.unsqueeze(-1) >> byte_shifts) & 0xFF  # [..., groups, bits]
    packed = packed.to(torch.uint8).reshape(*lead, groups * bits)
    return packed[..., : packed_size(count, bits)].contiguous()


def unpack_indices(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """uint8 [..., packed_size(count, bits)] → indices uint8 [..., count]."""
    _check_bits(bits)
    *lead, n_bytes = packed.shape
    if n_bytes != packed_size(count, bits):
        raise ValueError(f"{n_bytes} bytes cannot hold {count} indices of {bits} bits")
    if bits in _WHOLE_BYTE_BITS and count * bits % 8 == 0:
        if bits == 8:
            return packed.to(torch.uint8, copy=True)
        mask = (1 << bits) - 1
        parts = [(packed >> (bits * i)) & mask for i in range(8 // bits)]  # each [..., n_bytes]
        return torch.stack(parts, dim=-1).view(*lead, count)
    groups = -(-count // _GROUP)
    padded = torch.zeros(*lead, groups * bits, dtype=torch.int64, device=packed.device)
    padded[..., :n_bytes] = packed
    byte_shifts = torch.arange(bits, device=packed.device) * 8  # [bits]
    words = (padded.view(*lead, groups, bits) << byte_shifts).sum(-1)  # [..., groups]
    shifts = torch.arange(_GROUP, device=packed.device) * bits  # [8]
    indices = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., groups, 8]
    return indices.to(torch.uint8).reshape(*lead, groups * _GROUP)[..., :count]


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
