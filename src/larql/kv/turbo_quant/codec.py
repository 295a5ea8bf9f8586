"""Row codecs: a fixed number of bytes per vector, encoded and decoded in whole batches.

`TurboQuantCodec` is the TurboQuant-style MSE codec: store ‖x‖ as float32, rotate x/‖x‖ with the
signed Walsh–Hadamard transform (each coordinate then ≈ N(0, 1/d)), quantise every coordinate
with the Lloyd–Max codebook of that distribution and pack the indices tightly. One vector is
`[norm: f32 little-endian][packed indices]`, 4 + ceil(d·bits/8) bytes. Decoding is the reverse:
unpack → centroids → the same (self-inverse) rotation → × norm.

A dimension that is not a power of two is zero-padded to the next one before rotating (the
Walsh–Hadamard transform needs 2^k coordinates); the padded coordinates are stored too, so it
costs the bits of the padded length, and decoding drops them again.
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch

from larql.kv.turbo_quant.codebook import SUPPORTED_BITS, codebook
from larql.kv.turbo_quant.packing import pack_indices, packed_size, unpack_indices
from larql.kv.turbo_quant.rotation import next_power_of_two, rotation_matrix

NORM_BYTES = 4  # float32
_ZERO_NORM = 1e-12
# Bits of packed stream one lookup-table key covers: a whole number of indices per key.
_KEY_BITS = {2: 8, 3: 12, 4: 8}
_LOOKUP_TABLES: dict[tuple[int, int, torch.device], torch.Tensor] = {}
_EMPTY = torch.empty(0)  # the extension's "none" for an optional tensor


class RowCodec(Protocol):
    """Encodes vectors of one dimension into a fixed number of bytes each."""

    dim: int
    bytes_per_vector: int

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, dim] float → uint8 [N, bytes_per_vector]."""
        ...

    def decode(self, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 [N, bytes_per_vector] → [N, dim] in `dtype`."""
        ...


def split_norms(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [N, 4 + payload] → (norms [N, 1] float32, payload uint8 [N, payload])."""
    norms = data[:, :NORM_BYTES].contiguous().view(torch.float32)  # [N, 1]
    return norms, data[:, NORM_BYTES:]


def join_norms(norms: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    """norms [N] float32, payload uint8 [N, P] → uint8 [N, 4 + P]."""
    norm_bytes = norms.to(torch.float32).contiguous().view(torch.uint8).view(-1, NORM_BYTES)
    return torch.cat((norm_bytes, payload), dim=1)


class TurboQuantCodec:
    """Norm + signed WHT + Lloyd–Max quantiser at `bits` ∈ {2, 3, 4} for vectors of `dim`.

    `norm_correction`: the stored norm is ‖x‖ / ‖ũ‖, ũ the quantised unit vector, so a decoded
    vector has x's length (quantising shrinks ũ: E‖ũ‖² = 1 − the codebook's distortion, and
    every attention score shrinks with it). The same bytes and the same decoding."""

    def __init__(self, dim: int, bits: int, norm_correction: bool = False) -> None:
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
        if dim < 1:
            raise ValueError(f"dim must be ≥ 1, got {dim}")
        self.dim = dim
        self.bits = bits
        self.norm_correction = norm_correction
        self.rotated_dim = next_power_of_two(dim)
        self.payload_bytes = packed_size(self.rotated_dim, bits)
        self.bytes_per_vector = NORM_BYTES + self.payload_bytes

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, dim] float → uint8 [N, bytes_per_vector]."""
        x = self._pad(x.to(torch.float32))  # [N, d'] (statistics in float32 for any model dtype)
        norms = torch.linalg.vector_norm(x, dim=-1)  # [N]
        safe = torch.where(norms > _ZERO_NORM, norms, torch.ones_like(norms))
        unit = torch.where((norms > _ZERO_NORM).unsqueeze(-1), x / safe.unsqueeze(-1), 0.0)
        rotated = unit @ rotation_matrix(self.rotated_dim, torch.float32, x.device)  # [N, d']
        book = codebook(self.rotated_dim, self.bits, x.device)
        indices = book.quantise(rotated)
        if self.norm_correction:
            quantised = torch.linalg.vector_norm(book.dequantise(indices), dim=-1)  # [N]
            norms = norms / torch.where(quantised > _ZERO_NORM, quantised, 1.0)
        return join_norms(norms, pack_indices(indices, self.bits))

    def compiled_encode(
        self, kernels: ModuleType, rows: torch.Tensor, mean: torch.Tensor | None
    ) -> torch.Tensor:
        """rows [S, 2, Hkv, D] (float32 or float16) minus `mean` [2, Hkv, D] → one code row per
        token, uint8 [S, 2 · Hkv · bytes_per_vector], by the CPU extension (`coded_encode`)."""
        book = codebook(self.rotated_dim, self.bits)
        rotation = rotation_matrix(self.rotated_dim, torch.float32, rows.device)
        return kernels.coded_encode(
            rows,
            _EMPTY if mean is None else mean,
            rotation,
            book.boundaries,
            book.centroids,
            self.norm_correction,
        )

    def compiled_codes(self, device: torch.device) -> tuple[object, ...]:
        """The codec as the CPU extension's one-call step takes it (`decode_layers_coded`):
        bits, group (0: a codebook's), width, rotation, centroids, boundaries, norm correction,
        not fp8."""
        book = codebook(self.rotated_dim, self.bits)
        rotation = rotation_matrix(self.rotated_dim, torch.float32, device)
        return (
            self.bits,
            0,
            self.rotated_dim,
            rotation,
            book.centroids,
            book.boundaries,
            self.norm_correction,
            False,
        )

    def decode(self, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 [N, bytes_per_vector] → [N, dim] in `dtype`."""
        rotation = rotation_matrix(self.rotated_dim, torch.float32, data.device)
        x = self.decode_rotated(data, torch.float32) @ rotation  # [N, d']
        return x[:, : self.dim].to(dtype)

    def decode_rotated(self, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 [N, bytes_per_vector] → the vectors still in the rotated basis, [N, d'] in
        `dtype`: `decode` is this @ R, cut to `dim`. Dot products and weighted sums can be taken
        here and rotated once afterwards (R is orthogonal), instead of rotating every row."""
        norms, payload = split_norms(data)
        unit = self._centroid_values(payload)  # [N, d'] rotated unit vectors
        return unit.mul_(norms).to(dtype)

    def decode_indices(self, payload: torch.Tensor) -> torch.Tensor:
        """uint8 [N, payload_bytes] → quantiser indices [N, d'] (the plain, slower path)."""
        return unpack_indices(payload, self.rotated_dim, self.bits)

    def _centroid_values(self, payload: torch.Tensor) -> torch.Tensor:
        """uint8 [N, payload_bytes] → centroid values [N, d'] float32, through a lookup table
        from whole bytes (2, 4 bits) or 12-bit halves of 3-byte words (3 bits) to the run of
        centroids they encode: one gather instead of unpacking index by index."""
        n = payload.shape[0]
        table = self._lookup_table(payload.device)  # [2^key_bits, indices per key]
        if _KEY_BITS[self.bits] == 8:
            keys = payload.long()  # [N, P]
        else:
            groups = -(-payload.shape[1] // 3)
            padded = torch.nn.functional.pad(payload, (0, 3 * groups - payload.shape[1]))
            b = padded.view(n, groups, 3).to(torch.int32)
            words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)  # [N, G] 24-bit
            keys = torch.stack((words & 0xFFF, words >> 12), dim=-1).long()  # [N, G, 2]
        values = torch.nn.functional.embedding(keys, table)  # [..., indices per key]
        return values.reshape(n, -1)[:, : self.rotated_dim]

    def _lookup_table(self, device: torch.device) -> torch.Tensor:
        key = (self.rotated_dim, self.bits, device)
        table = _LOOKUP_TABLES.get(key)
        if table is None:
            key_bits = _KEY_BITS[self.bits]
            keys = torch.arange(1 << key_bits, device=device).unsqueeze(-1)  # [K, 1]
            shifts = torch.arange(key_bits // self.bits, device=device) * self.bits
            indices = (keys >> shifts) & ((1 << self.bits) - 1)  # [K, key_bits / bits]
            book = codebook(self.rotated_dim, self.bits, device)
            table = _LOOKUP_TABLES[key] = book.dequantise(indices)
        return table

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotated_dim == self.dim:
            return x
        return torch.nn.functional.pad(x, (0, self.rotated_dim - self.dim))
