"""Weight rows kept in their GGUF quantisation blocks, for one-token products that read the
blocks instead of float weights (a quarter of float32's bytes and less).

A matrix [out, in] is `BlockRows`: uint8 [out, in/32 · block bytes], each row the GGUF's blocks
of 32 weights. Formats (GGML's layouts; f16 is IEEE half, little-endian):
- Q8_0, 34 bytes: d f16, 32 × int8 q;             weight = d · q
- Q4_0, 18 bytes: d f16, 16 bytes of nibbles;     weight = d · (q − 8)
- Q4_1, 20 bytes: d f16, m f16, 16 bytes;         weight = d · q + m
- q4_k32, 24 bytes: d f32, m f32, 16 bytes;       weight = d · q + m (GGUF Q4_K, repacked
  at load: `larql.models.q4k`)
A Q4 block's byte j holds element j in its low nibble and element j + 16 in its high one.

`dequantize` is the pure-torch reference of these layouts (tested against the `gguf` package)
and of the compiled product (`larql.kernels.cpu`), which expands the blocks in registers and
multiplies them with x, by `activation`: `float` keeps x float32 (the float product with the
dequantised weights, up to the order of its sums); `int8` / `int16` first round x per block of
32 to integer codes (scale max|x| / 127 or / 32767; int8 is llama.cpp's choice) and sum integer
products of the codes: the float product with that rounded x.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import GGMLQuantizationType

from larql.models.q4k import repack_q4_k

BLOCK = 32
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q4_k32": 24}
FORMAT_CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q4_k32": 3}  # the extension's `format`
ACTIVATION_BITS = {"float": 0, "int8": 8, "int16": 16}  # its `activation_bits` argument
GGUF_FORMATS = {  # the GGUF types kept as blocks, and the format each is held in
    GGMLQuantizationType.Q8_0: "q8_0",
    GGMLQuantizationType.Q4_0: "q4_0",
    GGMLQuantizationType.Q4_1: "q4_1",
    GGMLQuantizationType.Q4_K: "q4_k32",
}


def block_width(qtype: GGMLQuantizationType) -> int:
    """How many weights one GGUF block of this type holds (a matrix's width is a multiple)."""
    return 256 if qtype == GGMLQuantizationType.Q4_K else BLOCK


@dataclass
class BlockRows:
    """A weight matrix [out_features, in_features] as rows of quantisation blocks. `tiled`: the
    same bytes rearranged for the CPU's AMX products (`inference.linear.kernel_rows` does it,
    in place, at the matrix's first product on such a CPU); a tiled matrix is read by those
    products only."""

    format: str  # a key of BLOCK_BYTES
    data: torch.Tensor  # uint8 [out_features, in_features / 32 · BLOCK_BYTES[format]]
    in_features: int
    activation: str = "float"  # a key of ACTIVATION_BITS: how one-row products take x
    tiled: bool = False

    def _require_rows(self) -> None:
        if self.tiled:
            raise ValueError("a tiled block matrix is read by the AMX products only")

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @staticmethod
    def from_numpy(format: str, raw: np.ndarray, shape: tuple[int, int]) -> BlockRows:
        """Bytes of a matrix `shape` (numpy order: out, in) in `format` → BlockRows."""
        out_features, in_features = shape
        data = torch.from_numpy(np.array(raw).reshape(out_features, -1))  # a copy we own
        return BlockRows(format, data, in_features)

    @staticmethod
    def from_gguf(
        qtype: GGMLQuantizationType, raw: np.ndarray, shape: tuple[int, int]
    ) -> BlockRows:
        """A GGUF tensor of a type in GGUF_FORMATS → BlockRows (Q4_K repacked)."""
        if qtype == GGMLQuantizationType.Q4_K:
            return BlockRows.from_numpy("q4_k32", repack_q4_k(raw, *shape), shape)
        return BlockRows.from_numpy(GGUF_FORMATS[qtype], raw, shape)

    def take_rows(self, order: torch.Tensor) -> BlockRows:
        """The rows in another order (order: [out] int64)."""
        self._require_rows()
        return replace(self, data=self.data[order].contiguous())

    @staticmethod
    def stack(parts: list[BlockRows]) -> BlockRows:
        """Matrices of one format and width, one below the other (a fused QKV, say)."""
        formats = {p.format for p in parts}
        widths = {p.in_features for p in parts}
        inputs = {p.activation for p in parts}
        if len(formats) != 1 or len(widths) != 1 or len(inputs) != 1:
            raise ValueError(f"cannot stack blocks of formats {formats} and widths {widths}")
        for part in parts:
            part._require_rows()
        return replace(parts[0], data=torch.cat([p.data for p in parts]))

    def dequantize(self) -> torch.Tensor:
        """→ float32 [out_features, in_features]."""
        self._require_rows()
        out_features = self.out_features
        blocks = self.data.view(out_features, -1, BLOCK_BYTES[self.format])  # [O, B, bytes]
        if self.format == "q4_k32":
            d, m = blocks[..., 0:8].contiguous().view(torch.float32).split(1, dim=-1)  # [O, B, 1]
            packed = blocks[..., 8:]  # [O, B, 16]
            q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).to(torch.float32)  # [O, B, 32]
            return (d * q + m).reshape(out_features, self.in_features)
        d = _halves(blocks[..., 0:2])  # [O, B, 1]
        if self.format == "q8_0":
            q = blocks[..., 2:].view(torch.int8).to(torch.float32)  # [O, B, 32]
            weights = d * q
        else:
            packed = blocks[..., 2:] if self.format == "q4_0" else blocks[..., 4:]  # [O, B, 16]
            q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).to(torch.float32)  # [O, B, 32]
            weights = d * (q - 8) if self.format == "q4_0" else d * q + _halves(blocks[..., 2:4])
        return weights.reshape(out_features, self.in_features)


def _halves(two_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian f16 → float32 [..., 1]."""
    return two_bytes.contiguous().view(torch.float16).to(torch.float32)


def fuse_layer_blocks(blocks: dict[str, BlockRows], layer: int) -> dict[str, BlockRows]:
    """A layer's block matrices under the fused names the forward pass uses (`wqkv`, `wo`,
    `w_gate_up`, `w_down`), from the unfused ones (`layers.i.wq`, …); a fused matrix whose
    parts are not all blocks of one format stays float."""
    p = f"layers.{layer}."
    fused: dict[str, BlockRows] = {}
    for name, parts in (
        ("wqkv", ("wq", "wk", "wv")),
        ("wo", ("wo",)),
        ("w_gate_up", ("w_gate", "w_up")),
        ("w_down", ("w_down",)),
    ):
        found = [b for part in parts if (b := blocks.get(p + part)) is not None]
        if len(found) == len(parts) and len({f.format for f in found}) == 1:
            fused[name] = BlockRows.stack(found) if len(found) > 1 else found[0]
    return fused
