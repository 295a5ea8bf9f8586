"""The FFN shard wire format, shared by the client (`remote`) and the
server (`larql.server.ffn_shard`) so the framing exists once. All integers little-endian.

Request (`Content-Type: application/x-larql-ffn`; the residual is always f32):
    single  layer u32, seq_len u32, flags u32 (bit0 full_output), top_k u32, residual f32[S·H]
    batch   0xFFFFFFFF, num_layers u32, layers u32[K], seq_len u32, flags u32, top_k u32,
            residual f32[S·H]            (every listed layer's FFN of the same residual)
Response (encoding chosen by `Accept`: f32, f16 or i8):
    single  layer u32, seq_len u32, latency_ms f32, values
    batch   0xFFFFFFFF, num_results u32, latency_ms f32, then per result
            layer u32, seq_len u32, num_floats u32 (= S·H), values
    values  f32: 4-byte floats; f16: 2-byte halves; i8: per position
            [scale f32][zero_point f32 (0, ignored)][i8 × H], value = q × scale
JSON fallback: request `{"layer": L | "layers": [..], "seq_len": S, "residual": [S·H floats],
"top_k": 0, "full_output": true}`; response `{"layer", "seq_len", "latency_ms", "output"}` or
`{"latency_ms", "results": [{"layer", "seq_len", "output"}]}`.

top_k = 0 asks for the shard's default, the dense-equivalent walk.

A request declares its size — K layers (each listed once: a repeated id is refused), S rows of
H values — and its body must carry exactly that; its answer is then K · S · H values, no more
(`WalkRequest.output_values`), which the shard checks against its limits before computing.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from larql.errors import LarqlError

F32, F16, I8 = "f32", "f16", "i8"
MEDIA_TYPES = {
    F32: "application/x-larql-ffn",
    F16: "application/x-larql-ffn-f16",
    I8: "application/x-larql-ffn-i8",
}
JSON_MEDIA_TYPE = "application/json"
BATCH_MARKER = 0xFFFFFFFF
FULL_OUTPUT = 1
MAX_BATCH_LAYERS = 4096


class WireFormatError(LarqlError):
    """A body that does not follow the framing; the server answers `status`."""

    status = 400


class HiddenSizeMismatch(WireFormatError):
    status = 422


@dataclass(frozen=True)
class WalkRequest:
    layers: tuple[int, ...]
    batched: bool
    residual: np.ndarray  # [S, H] float32
    top_k: int = 0

    @property
    def seq_len(self) -> int:
        return int(self.residual.shape[0])

    @property
    def output_values(self) -> int:
        """How many values the answer holds: every listed layer's [S, H] output."""
        return len(self.layers) * self.residual.size


def wire_for_media_type(media_type: str) -> str | None:
    base = media_type.split(";", 1)[0].strip().lower()
    return next((w for w, m in MEDIA_TYPES.items() if m == base), None)


# ---------------------------------------------------------------------------- requests


def _as_f32(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()


def encode_request(layers: int | Sequence[int], x: torch.Tensor, top_k: int = 0) -> bytes:
    """One layer (an int) → a single request; a list of layers → a batch request."""
    residual = _as_f32(x)  # [S, H]
    tail = struct.pack("<III", residual.shape[0], FULL_OUTPUT, top_k) + residual.tobytes()
    if isinstance(layers, int):
        return struct.pack("<I", layers) + tail
    head = struct.pack(f"<II{len(layers)}I", BATCH_MARKER, len(layers), *layers)
    return head + tail


def decode_request(body: bytes, hidden_size: int) -> WalkRequest:
    if len(body) < 16:
        raise WireFormatError(f"request of {len(body)} bytes is shorter than its 16-byte header")
    (first,) = struct.unpack_from("<I", body, 0)
    offset, batched = 4, first == BATCH_MARKER
    if batched:
        (count,) = struct.unpack_from("<I", body, 4)
        if not 1 <= count <= MAX_BATCH_LAYERS:
            raise WireFormatError(f"batch of {count} layers; 1..{MAX_BATCH_LAYERS} accepted")
        if len(body) < 8 + 4 * count + 12:
            raise WireFormatError(f"batch header for {count} layers is truncated")
        layers = _distinct(struct.unpack_from(f"<{count}I", body, 8))
        offset = 8 + 4 * count
    else:
        layers = (first,)
    seq_len, flags, top_k = struct.unpack_from("<III", body, offset)
    offset += 12
    if not flags & FULL_OUTPUT:
        raise WireFormatError("only full_output requests (flags bit 0 set) are served")
    return WalkRequest(layers, batched, _residual(body[offset:], seq_len, hidden_size), top_k)


def _distinct(layers: Sequence[int]) -> tuple[int, ...]:
    """A batch's layer ids, each once: a repeated one would multiply the answer, not the work
    asked for."""
    repeated = sorted(layer for layer, n in Counter(layers).items() if n > 1)
    if repeated:
        shown = ", ".join(str(layer) for layer in repeated[:8])
        more = f" and {len(repeated) - 8} more" if len(repeated) > 8 else ""
        raise WireFormatError(f"the batch repeats layer ids {shown}{more}; list each layer once")
    return tuple(layers)


def _residual(raw: bytes, seq_len: int, hidden_size: int) -> np.ndarray:
    """The residual the body carries: exactly the declared seq_len rows of hidden_size f32."""
    if seq_len < 1:
        raise WireFormatError("seq_len must be ≥ 1")
    if len(raw) % 4 or (len(raw) // 4) % seq_len:
        raise WireFormatError(f"residual of {len(raw)} bytes does not split into {seq_len} rows")
    width = len(raw) // 4 // seq_len
    if width != hidden_size:
        raise HiddenSizeMismatch(
            f"the body carries {len(raw) // 4} values for the {seq_len} rows it declares: "
            f"{width} per row; this shard's hidden size is {hidden_size}"
        )
    return np.frombuffer(raw, dtype="<f4").reshape(seq_len, hidden_size)


def decode_json_request(payload: Any, hidden_size: int) -> WalkRequest:
    if not isinstance(payload, dict):
        raise WireFormatError("JSON request must be an object")
    if "layers" in payload:
        layers, batched = payload["layers"], True
        if not isinstance(layers, list) or not 1 <= len(layers) <= MAX_BATCH_LAYERS:
            raise WireFormatError(f"layers must be a list of 1..{MAX_BATCH_LAYERS} integers")
    elif "layer" in payload:
        layers, batched = [payload["layer"]], False
    else:
        raise WireFormatError("JSON request needs layer or layers")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in layers):
        raise WireFormatError("layer ids must be non-negative integers")
    layers = _distinct(layers)
    if payload.get("full_output", True) is not True:
        raise WireFormatError("only full_output requests are served")
    top_k, residual = payload.get("top_k", 0), payload.get("residual")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise WireFormatError("top_k must be a non-negative integer")
    if not isinstance(residual, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in residual
    ):
        raise WireFormatError("residual must be a flat list of numbers")
    seq_len = payload.get("seq_len", max(1, len(residual) // max(hidden_size, 1)))
    if not isinstance(seq_len, int) or isinstance(seq_len, bool):
        raise WireFormatError("seq_len must be an integer")
    try:
        raw = np.asarray(residual, dtype="<f4").tobytes()
    except OverflowError:  # an integer past any float
        raise WireFormatError("residual holds a number too large for f32") from None
    return WalkRequest(layers, batched, _residual(raw, seq_len, hidden_size), top_k)


# ---------------------------------------------------------------------------- responses


def encode_values(out: np.ndarray, wire: str) -> bytes:
    """out: [S, H] float32 → the value bytes of one result in the given encoding."""
    if wire == F32:
        return out.astype("<f4").tobytes()
    if wire == F16:
        return out.astype("<f2").tobytes()
    scale = (np.abs(out).max(axis=1) / 127.0).astype("<f4")  # [S]
    safe = np.where(scale > 0, scale, 1.0)[:, None]
    q = np.clip(np.rint(out / safe), -127, 127).astype("i1")  # [S, H]
    head = np.zeros((out.shape[0], 2), dtype="<f4")
    head[:, 0] = scale
    rows = [head[i].tobytes() + q[i].tobytes() for i in range(out.shape[0])]
    return b"".join(rows)


def values_size(seq_len: int, hidden_size: int, wire: str) -> int:
    if wire == I8:
        return seq_len * (8 + hidden_size)
    return seq_len * hidden_size * (4 if wire == F32 else 2)


def decode_values(raw: bytes, seq_len: int, hidden_size: int, wire: str) -> np.ndarray:
    if len(raw) != values_size(seq_len, hidden_size, wire):
        raise WireFormatError(
            f"{wire} values of {len(raw)} bytes for {seq_len}×{hidden_size}; expected "
            f"{values_size(seq_len, hidden_size, wire)}"
        )
    if wire == F32:
        return np.frombuffer(raw, dtype="<f4").reshape(seq_len, hidden_size)
    if wire == F16:
        return np.frombuffer(raw, dtype="<f2").astype(np.float32).reshape(seq_len, hidden_size)
    rows = np.frombuffer(raw, dtype="u1").reshape(seq_len, 8 + hidden_size)
    scale = rows[:, :4].copy().view("<f4")  # [S, 1]
    q = rows[:, 8:].view("i1").astype(np.float32)  # [S, H]
    return q * scale


def encode_response(
    results: Sequence[tuple[int, np.ndarray]], latency_ms: float, wire: str, batched: bool
) -> bytes:
    if not batched:
        layer, out = results[0]
        return struct.pack("<IIf", layer, out.shape[0], latency_ms) + encode_values(out, wire)
    parts = [struct.pack("<IIf", BATCH_MARKER, len(results), latency_ms)]
    for layer, out in results:
        parts.append(struct.pack("<III", layer, out.shape[0], out.size))
        parts.append(encode_values(out, wire))
    return b"".join(parts)


def decode_response(
    body: bytes, wire: str, hidden_size: int, batched: bool
) -> tuple[list[tuple[int, np.ndarray]], float]:
    """→ ([(layer, output [S, H] float32)], server latency ms). Raises `WireFormatError`."""
    if len(body) < 12:
        raise WireFormatError(f"response of {len(body)} bytes is shorter than its header")
    first, second, latency = struct.unpack_from("<IIf", body, 0)
    if not batched:
        if first == BATCH_MARKER:
            raise WireFormatError("batch response to a single request")
        return [(first, decode_values(body[12:], second, hidden_size, wire))], latency
    if first != BATCH_MARKER:
        raise WireFormatError("single response to a batch request")
    results, offset = [], 12
    for _ in range(second):
        if len(body) < offset + 12:
            raise WireFormatError("batch response is truncated")
        layer, seq_len, count = struct.unpack_from("<III", body, offset)
        offset += 12
        if seq_len < 1 or count != seq_len * hidden_size:
            raise WireFormatError(f"result for layer {layer}: {count} values for {seq_len} rows")
        size = values_size(seq_len, hidden_size, wire)
        results.append(
            (layer, decode_values(body[offset : offset + size], seq_len, hidden_size, wire))
        )
        offset += size
    if offset != len(body):
        raise WireFormatError(f"{len(body) - offset} trailing bytes after the batch response")
    return results, latency
