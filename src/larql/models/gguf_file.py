"""A fast GGUF reader: header parsed with `struct`, tensor bytes memory-mapped.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array (5 s for
SmolLM2, 24 s for Gemma 3); here only the tensor table is kept and the tokenizer arrays are
decoded in one pass. Dequantization itself is the `gguf` package's job.

The file is untrusted: every count, length and dimension in the header is checked against the
bytes left in the file (and a sane limit) before anything is read or sized from it, and every
tensor must lie inside the file; a bad file is a one-line `ModelFormatError` naming it.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from larql.models.errors import ModelFormatError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (scalars only).
_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY_TYPES = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)
# Sane limits on the header's counts, far above any released model (the bytes left in the file
# bound them too): metadata keys, tensors, elements of one metadata array, array nesting.
_MAX_KEYS = 1 << 16
_MAX_TENSORS = 1 << 20
_MAX_ARRAY = 1 << 24
_MAX_NESTING = 2
_MAX_DIMS = 4  # GGML_MAX_DIMS
# the fewest bytes one metadata pair (key length, type, a 1-byte value) and one tensor entry
# (name length, dimension count, one dimension, type, offset) take
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8


@dataclass(frozen=True)
class GgufTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: (out_features, in_features) for a matrix
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GgufFile:
    """Metadata and lazily dequantized tensors of one `.gguf` file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.metadata, self.tensors = _read_header(f, size)
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        except ModelFormatError as e:
            raise ModelFormatError(f"{self.path}: {e}") from None
        except OSError as e:
            raise ModelFormatError(f"cannot read {self.path}: {e.strerror or e}") from None

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        """`{architecture}.{suffix}`, e.g. `llama.block_count`."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    def strings(self, key: str) -> list[str]:
        """A metadata array of strings (the tokenizer's tokens, merges); [] where absent."""
        value = self.metadata.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ModelFormatError(f"{self.path}: {key} is not an array of strings")
        return value

    def raw_bytes(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        return self._data[info.offset : info.offset + info.nbytes]

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in numpy order (an `nn.Linear.weight` layout for matrices)."""
        info = self.tensors[name]
        raw = self.raw_bytes(name)
        if info.qtype == GGMLQuantizationType.F32:
            return np.array(raw.view(np.float32).reshape(info.shape))
        if info.qtype == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(info.shape).astype(np.float32)
        rows = math.prod(info.shape[:-1])
        try:
            flat = dequantize(raw.reshape(rows, -1), info.qtype)  # [rows, cols]
        except NotImplementedError:
            raise ModelFormatError(
                f"{self.path}: tensor {name} is stored as {info.qtype.name}, which the gguf "
                "package cannot dequantize"
            ) from None
        return np.asarray(flat, dtype=np.float32).reshape(info.shape)


class _Header:
    """The header of one file, read with every count and length checked against the bytes
    left before anything is read or sized from it: a crafted count is a refusal, never an
    allocation."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f = f
        self.size = size
        self.pos = 0

    def read(self, n: int, what: str) -> bytes:
        if n > self.size - self.pos:
            raise ModelFormatError(
                f"truncated: {what} needs {n} bytes at offset {self.pos}, the file has "
                f"{self.size - self.pos} left"
            )
        self.pos += n
        return self.f.read(n)

    def unpack(self, fmt: str, what: str) -> tuple[Any, ...]:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt), what))

    def count(self, what: str, item_bytes: int, limit: int) -> int:
        """A u64 count of items of at least `item_bytes` each, bounded by the bytes left and
        by `limit`."""
        (n,) = self.unpack("<Q", what)
        if n > limit or n * item_bytes > self.size - self.pos:
            raise ModelFormatError(
                f"{what} = {n} is more than the file can hold ({self.size - self.pos} bytes "
                f"left at offset {self.pos}; at most {limit})"
            )
        return n

    def string(self, what: str) -> str:
        n = self.count(f"the length of {what}", 1, self.size)
        return self.read(n, what).decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        if vtype == _STRING:
            return self.string(f"the value of {key}")
        if vtype == _ARRAY:
            return self.array(key, depth)
        if vtype not in _SCALAR_FORMATS:
            raise ModelFormatError(f"metadata {key} has an unknown value type {vtype}")
        (value,) = self.unpack(_SCALAR_FORMATS[vtype], f"the value of {key}")
        return value

    def array(self, key: str, depth: int) -> Any:
        if depth >= _MAX_NESTING:
            raise ModelFormatError(f"metadata {key} nests arrays deeper than {_MAX_NESTING}")
        (item_type,) = self.unpack("<I", f"the item type of {key}")
        if item_type == _STRING:
            return self.strings(key, self.count(f"the length of {key}", 8, _MAX_ARRAY))
        if item_type in _NUMPY_TYPES:
            dtype = np.dtype(_NUMPY_TYPES[item_type])
            n = self.count(f"the length of {key}", dtype.itemsize, _MAX_ARRAY)
            return np.frombuffer(self.read(n * dtype.itemsize, key), dtype=dtype)
        if item_type != _ARRAY:
            raise ModelFormatError(f"metadata {key} has an unknown item type {item_type}")
        n = self.count(f"the length of {key}", 12, _MAX_ARRAY)
        return [self.array(key, depth + 1) for _ in range(n)]

    def strings(self, key: str, count: int) -> list[str]:
        # the tokenizer's arrays hold ~10⁵ strings: one bounds check each, no call per string
        read, unpack, size, pos = self.f.read, struct.unpack, self.size, self.pos
        out = []
        for i in range(count):
            if size - pos < 8:
                break
            (n,) = unpack("<Q", read(8))
            pos += 8
            if n > size - pos:
                self.pos = pos
                raise ModelFormatError(
                    f"truncated: string {i} of {key} is {n} bytes at offset {pos}, the file "
                    f"has {size - pos} left"
                )
            out.append(read(n).decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        if len(out) < count:
            raise ModelFormatError(f"truncated: {key} ends after {len(out)} of {count} strings")
        return out


def _read_header(f: BinaryIO, size: int) -> tuple[dict[str, Any], dict[str, GgufTensorInfo]]:
    header = _Header(f, size)
    if size < 4 or header.read(4, "the magic") != _MAGIC:
        raise ModelFormatError("not a GGUF file (bad magic)")
    (version,) = header.unpack("<I", "the version")
    if version not in _VERSIONS:
        raise ModelFormatError(f"GGUF version {version} is not supported (2 or 3)")
    (n_tensors,) = header.unpack("<Q", "the tensor count")
    n_kv = header.count("the metadata key count", _MIN_KV_BYTES, _MAX_KEYS)
    if n_tensors > _MAX_TENSORS or n_tensors * _MIN_TENSOR_BYTES > size - header.pos:
        raise ModelFormatError(
            f"the tensor count {n_tensors} is more than the file can hold ({size} bytes; at "
            f"most {_MAX_TENSORS})"
        )
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = header.string(f"metadata key {i}")
        (vtype,) = header.unpack("<I", f"the type of {key}")
        metadata[key] = header.value(vtype, key)
    infos = [_read_tensor_info(header, i) for i in range(n_tensors)]
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not _is_power_of_two(alignment):
        raise ModelFormatError(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-header.pos // alignment) * alignment
    tensors = {}
    for name, dims, qtype, offset in infos:
        if name in tensors:
            raise ModelFormatError(f"tensor {name} is listed twice")
        tensors[name] = _tensor_extent(name, dims, qtype, offset, data_start, alignment, size)
    return metadata, tensors


def _read_tensor_info(
    header: _Header, i: int
) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = header.string(f"the name of tensor {i}")
    (n_dims,) = header.unpack("<I", f"the dimension count of {name}")
    if not 1 <= n_dims <= _MAX_DIMS:
        raise ModelFormatError(f"tensor {name} has {n_dims} dimensions (1..{_MAX_DIMS})")
    dims = header.unpack(f"<{n_dims}Q", f"the shape of {name}")
    qtype_id, offset = header.unpack("<IQ", f"the type and offset of {name}")
    try:
        qtype = GGMLQuantizationType(qtype_id)
    except ValueError:
        raise ModelFormatError(f"tensor {name} has an unknown type {qtype_id}") from None
    if qtype not in GGML_QUANT_SIZES:
        raise ModelFormatError(f"tensor {name} has type {qtype.name}, which has no block size")
    return name, dims, qtype, offset


def _tensor_extent(
    name: str,
    dims: tuple[int, ...],
    qtype: GGMLQuantizationType,
    offset: int,
    data_start: int,
    alignment: int,
    size: int,
) -> GgufTensorInfo:
    """The tensor's place in the file, checked: whole blocks per row, aligned, inside the file."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    shape = tuple(int(d) for d in reversed(dims))
    if min(dims) < 1 or dims[0] % block_size:
        raise ModelFormatError(
            f"tensor {name} has shape {shape}: every dimension ≥ 1 and rows of whole "
            f"{qtype.name} blocks ({block_size} values) are needed"
        )
    nbytes = math.prod(dims) // block_size * type_size
    start = data_start + offset
    if offset % alignment:
        raise ModelFormatError(f"tensor {name} is at offset {offset}, not aligned to {alignment}")
    if start + nbytes > size:
        raise ModelFormatError(
            f"tensor {name} ({qtype.name} {shape}, {nbytes} bytes at {start}) runs past the end "
            f"of the file ({size} bytes)"
        )
    return GgufTensorInfo(name, shape, qtype, start, nbytes)


def _is_power_of_two(value: object) -> bool:
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value > 0
        and not (value & (value - 1))
    )
