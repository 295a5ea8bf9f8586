"""turbo-quant's 4-bit centroid lookup in PTX (`kernels.centroid_lookup`), run instruction by
instruction by a small emulator of the PTX it uses, against the codebook: every byte value in
every position of an instance decodes to the 16-bit centroids the gather path looks up. (The
CUDA tests run the same PTX in the partial launch against the gather path.)"""

from __future__ import annotations

import random
import re

import pytest
import torch

from larql.kv.turbo_quant.codebook import codebook

kernels = pytest.importorskip("larql.kv.turbo_quant.kernels")

MASK = 0xFFFFFFFF


def permute(a: int, b: int, selector: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte (nibble i of the selector & 7)
    of the 8 bytes b:a, or that byte's top bit replicated where the nibble's bit 3 is set."""
    source = a | (b << 32)
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 15
        byte = (source >> (8 * (nibble & 7))) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


OPS = {
    "mov.b32": lambda a: a,
    "not.b32": lambda a: ~a & MASK,
    "and.b32": lambda a, b: a & b,
    "xor.b32": lambda a, b: a ^ b,
    "sub.u32": lambda a, b: (a - b) & MASK,
    "shr.b32": lambda a, b: a >> b,
    "shl.b32": lambda a, b: (a << b) & MASK,
    "prmt.b32": permute,
}


def run_ptx(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """The instructions of `asm` on 32-bit registers: operands are registers, $N, or hex."""
    registers = dict(inputs)
    for line in asm.strip("{} ").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, operands = re.match(r"(\S+)\s+(.*)", line).groups()
        target, *sources = [o.strip() for o in operands.split(",")]
        values = [int(s, 0) if s[0].isdigit() else registers[s] for s in sources]
        registers[target] = OPS[op](*values)
    return registers


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 256])
def test_every_packed_byte_decodes_to_its_two_centroids(dtype: torch.dtype, dim: int) -> None:
    pack = kernels.LOOKUP_PACK
    centroids = codebook(dim, 4).centroids
    asm = kernels.centroid_lookup(centroids, dtype, pack)
    table = centroids.to(dtype).view(torch.int16).to(torch.int32).bitwise_and(0xFFFF).tolist()
    draw = random.Random(dim)
    for value in range(256):
        for position in range(pack):  # each byte value in each position, random neighbours
            data = [draw.randrange(256) for _ in range(pack)]
            data[position] = value
            words = {
                f"${pack + w}": int.from_bytes(bytes(data[4 * w : 4 * w + 4]), "little")
                for w in range(pack // 4)
            }
            out = run_ptx(asm, words)
            halves = [(out[f"${r}"] >> (16 * h)) & 0xFFFF for r in range(pack) for h in (0, 1)]
            even, odd = halves[:pack], halves[pack:]
            assert even == [table[b & 15] for b in data]
            assert odd == [table[b >> 4] for b in data]
