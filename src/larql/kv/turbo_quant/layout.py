"""How turbo-quant lays one token's K/V out as codec vectors: [K head 0 … K head Hkv−1,
V head 0 … V head Hkv−1], each a head_dim vector (encoded: one row of the layer's store)."""

from __future__ import annotations

import torch


def token_vectors(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v: [Hkv, S, D] → [S·2·Hkv, D], token by token in the store's order."""
    heads, s, dim = k.shape
    return torch.stack((k, v)).permute(2, 0, 1, 3).reshape(s * 2 * heads, dim)


def ring_slots(recent: int) -> int:
    """Slots of the ring holding a layer's `recent` newest rows: one more than the rows, so
    the new row goes into the slot of a row already coded (token t in slot t mod (recent + 1))
    while the row leaving the ring is still read — the kernels' combine launch encodes the
    leaving row and attends the ring in programs of their own, which run at once."""
    return recent + 1 if recent else 1
