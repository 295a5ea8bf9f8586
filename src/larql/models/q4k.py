"""GGUF Q4_K matrices repacked into blocks of 32 the CPU kernels read ("q4_k32").

A Q4_K super-block holds 256 weights in 144 bytes: d (f16), dmin (f16), 12 bytes packing eight
6-bit scales s_j and eight 6-bit minimums m_j, then 128 bytes of 4-bit codes — each 64 weights
are 32 bytes, the first 32 weights in their low nibbles and the next 32 in their high ones.
Weight i of sub-block j is d · s_j · q_i − dmin · m_j.

Repacked, each sub-block of 32 becomes 24 bytes: its scale d · s_j and offset −dmin · m_j as
float32 (exact: an f16 times a 6-bit integer fits float32's mantissa), then 16 bytes of codes
in the Q4_0 / Q4_1 order (byte k: weight k in the low nibble, weight k + 16 in the high one).
So a repacked weight is scale · q + offset, the value Q4_K's own dequantisation gives, at
24 / 18 = 1.33× Q4_K's bytes.
"""

from __future__ import annotations

import numpy as np

SUPER_BLOCK = 256
SUPER_BLOCK_BYTES = 144
REPACKED_BYTES = 24  # per block of 32


def scales_and_minimums(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [..., 12] → the eight 6-bit scales and minimums, uint8 [..., 8] each. Bytes 0–3
    hold scales 0–3 in their low 6 bits, bytes 4–7 minimums 0–3; scales and minimums 4–7 take
    their low 4 bits from bytes 8–11 (low / high nibble) and their top 2 bits from the top 2
    bits of bytes 0–3 (scales) and 4–7 (minimums)."""
    first, second, third = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate((first & 0x3F, (third & 0x0F) | ((first >> 2) & 0x30)), axis=-1)
    minimums = np.concatenate((second & 0x3F, (third >> 4) | ((second >> 2) & 0x30)), axis=-1)
    return scales, minimums


def repack_q4_k(raw: np.ndarray, out_features: int, in_features: int) -> np.ndarray:
    """GGUF Q4_K bytes of a matrix [out, in] (in a multiple of 256) → uint8
    [out, in/32 · 24] in the repacked layout."""
    supers = raw.reshape(out_features, in_features // SUPER_BLOCK, SUPER_BLOCK_BYTES)
    d = supers[..., 0:2].copy().view(np.float16).astype(np.float32)  # [O, S, 1]
    dmin = supers[..., 2:4].copy().view(np.float16).astype(np.float32)  # [O, S, 1]
    scales, minimums = scales_and_minimums(supers[..., 4:16])  # [O, S, 8] each
    block_scale = (d * scales.astype(np.float32)).reshape(out_features, -1, 1)  # [O, B, 1]
    block_offset = (-(dmin * minimums.astype(np.float32))).reshape(out_features, -1, 1)
    packed = supers[..., 16:].reshape(out_features, -1, 4, 1, 32)  # [O, S, 64-chunks, 1, 32]
    codes = (packed >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    codes = codes.reshape(out_features, -1, 32)  # [O, B, 32]: sub-block j's codes in order
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)  # [O, B, 16]
    repacked = np.concatenate(
        (
            np.ascontiguousarray(block_scale).view(np.uint8),  # [O, B, 4]
            np.ascontiguousarray(block_offset).view(np.uint8),  # [O, B, 4]
            nibbles.astype(np.uint8),
        ),
        axis=-1,
    )  # [O, B, 24]
    return repacked.reshape(out_features, -1)
