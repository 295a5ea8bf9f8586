"""MXFP4, the format GPT-OSS checkpoints ship their experts in: every 32 weights share one
power-of-two scale, each weight a 4-bit float (E2M1: a sign, 2 exponent bits, 1 mantissa bit).

A tensor `X` of shape [..., R, C] is stored as `X_blocks`: uint8 [..., R, C/32, 16] (two
weights per byte, the even-indexed one in the low nibble) and `X_scales`: uint8 [..., R, C/32],
the exponent of each group with a bias of 127. The loader dequantizes them to float32."""

from __future__ import annotations

import torch

GROUP = 32  # weights per shared scale
SCALE_BIAS = 127
# the 16 values of a 4-bit E2M1 code: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] → float32 [..., G·32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            f"(expected blocks [..., G, {GROUP // 2}] and scales [..., G])"
        )
    if blocks.is_meta:  # a structure (`larql.models.structure`): the shape alone
        return torch.empty((*scales.shape[:-1], scales.shape[-1] * GROUP), device="meta")
    table = torch.tensor(E2M1, dtype=torch.float32)
    packed = blocks.to(torch.int64)
    pairs = torch.stack((table[packed & 15], table[packed >> 4]), dim=-1)  # [..., G, 16, 2]
    values = pairs.flatten(-2)  # [..., G, 32]: even weights from the low nibbles
    exponents = scales.to(torch.int32) - SCALE_BIAS  # [..., G]
    return torch.ldexp(values, exponents[..., None]).flatten(-2)
