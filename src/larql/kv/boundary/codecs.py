"""Residual codecs of boundary frames: a hidden row [H] ↔ bytes.

- `bf16`: round-to-nearest-even on the float32 bit pattern,
  `(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16`, stored as little-endian u16 (2 bytes/element);
  decoding shifts back `u16 << 16`.
- `int8_clip3sigma`: `[scale f32 LE][i8 × d]` with `scale = 3σ / 127` (σ the population standard
  deviation of the row); each element is clamped to ±127 steps and then rounded half away from
  zero. Elements within ±3σ come back within scale/2; elements beyond are clipped to ±127·scale.

Both work on float32 (a float64 row is narrowed first; the round trip returns float32).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from larql.errors import LarqlError

CodecName = Literal["bf16", "int8_clip3sigma"]
CODECS: tuple[CodecName, ...] = ("bf16", "int8_clip3sigma")
INT8_LEVELS = 127
CLIP_SIGMAS = 3.0


class CodecError(LarqlError):
    """A payload whose size or codec name does not match what was asked for."""


def _row_f32(row: torch.Tensor) -> np.ndarray:
    return row.detach().reshape(-1).to(device="cpu", dtype=torch.float32).numpy()


# ---------------------------------------------------------------------------- bf16


def bf16_encode(row: torch.Tensor) -> bytes:
    bits = _row_f32(row).view(np.uint32).astype(np.uint64)  # no wrap in the rounding add
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def bf16_decode(payload: bytes, size: int) -> torch.Tensor:
    if len(payload) != 2 * size:
        raise CodecError(f"bf16 payload of {len(payload)} bytes for {size} elements")
    halves = np.frombuffer(payload, dtype="<u2").astype(np.uint32) << 16
    return torch.from_numpy(halves.view(np.float32).copy())


# ---------------------------------------------------------------------------- int8


def int8_scale(row: np.ndarray) -> float:
    sigma = float(np.sqrt(np.mean((row.astype(np.float64) - row.mean(dtype=np.float64)) ** 2)))
    return float(np.float32(CLIP_SIGMAS * sigma / INT8_LEVELS))


def int8_encode(row: torch.Tensor) -> bytes:
    x = _row_f32(row)
    scale = int8_scale(x)
    if scale > 0.0 and np.isfinite(scale):
        steps = np.clip(x / np.float32(scale), -INT8_LEVELS, INT8_LEVELS)
        q = np.sign(steps) * np.floor(np.abs(steps) + 0.5)  # round half away from zero
    else:  # a constant row: nothing to spread over the levels
        scale, q = 0.0, np.zeros_like(x)
    return np.float32(scale).astype("<f4").tobytes() + q.astype(np.int8).tobytes()


def int8_decode(payload: bytes, size: int) -> torch.Tensor:
    if len(payload) != 4 + size:
        raise CodecError(f"int8_clip3sigma payload of {len(payload)} bytes for {size} elements")
    scale = np.frombuffer(payload[:4], dtype="<f4")[0]
    q = np.frombuffer(payload[4:], dtype=np.int8).astype(np.float32)
    return torch.from_numpy(q * scale)


# ---------------------------------------------------------------------------- by name


def encode(codec: str, row: torch.Tensor) -> bytes:
    if codec == "bf16":
        return bf16_encode(row)
    if codec == "int8_clip3sigma":
        return int8_encode(row)
    raise CodecError(f"unknown residual codec {codec!r}; accepted: {', '.join(CODECS)}")


def decode(codec: str, payload: bytes, size: int) -> torch.Tensor:
    """payload → float32 row [size]."""
    if codec == "bf16":
        return bf16_decode(payload, size)
    if codec == "int8_clip3sigma":
        return int8_decode(payload, size)
    raise CodecError(f"unknown residual codec {codec!r}; accepted: {', '.join(CODECS)}")


def round_trip(codec: str, row: torch.Tensor) -> torch.Tensor:
    """row [H] (any float dtype) → what the codec gives back, float32 [H]."""
    return decode(codec, encode(codec, row), row.numel())
