"""A fast GGUF reader: header parsed with `struct`, tensor bytes memory-mapped.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array (5 s for
SmolLM2, 24 s for Gemma 3); here only the tensor table is kept and the tokenizer arrays are
decoded in one pass. Dequantization itself is the `gguf` package's job.
"""

from __future__ import annotations

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
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
    6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_NUMPY_TYPES = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}  # fmt: skip
_STRING, _ARRAY = 8, 9


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
        with open(self.path, "rb") as f:
            self.metadata, self.tensors = _read_header(f, self.path)
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        """`{architecture}.{suffix}`, e.g. `llama.block_count`."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

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
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        flat = dequantize(raw.reshape(rows, -1), info.qtype)  # [rows, cols]
        return np.asarray(flat, dtype=np.float32).reshape(info.shape)


def _read_header(f: BinaryIO, path: Path) -> tuple[dict[str, Any], dict[str, GgufTensorInfo]]:
    if f.read(4) != _MAGIC:
        raise ModelFormatError(f"{path} is not a GGUF file (bad magic)")
    (version,) = struct.unpack("<I", f.read(4))
    if version < 2:
        raise ModelFormatError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
    n_tensors, n_kv = struct.unpack("<QQ", f.read(16))
    metadata = {}
    for _ in range(n_kv):
        key = _read_string(f)
        (vtype,) = struct.unpack("<I", f.read(4))
        metadata[key] = _read_value(f, vtype)
    infos = []
    for _ in range(n_tensors):
        name = _read_string(f)
        (n_dims,) = struct.unpack("<I", f.read(4))
        dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
        qtype_id, offset = struct.unpack("<IQ", f.read(12))
        infos.append((name, dims, GGMLQuantizationType(qtype_id), offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-f.tell() // alignment) * alignment
    tensors = {}
    for name, dims, qtype, offset in infos:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(dims))
        shape = tuple(int(d) for d in reversed(dims))
        nbytes = n_elements // block_size * type_size
        tensors[name] = GgufTensorInfo(name, shape, qtype, data_start + offset, nbytes)
    return metadata, tensors


def _read_string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, vtype: int) -> Any:
    if vtype == _STRING:
        return _read_string(f)
    if vtype == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type == _STRING:
            return _read_string_array(f, count)
        if item_type in _NUMPY_TYPES:
            dtype = np.dtype(_NUMPY_TYPES[item_type])
            return np.frombuffer(f.read(count * dtype.itemsize), dtype=dtype)
        return [_read_value(f, item_type) for _ in range(count)]
    fmt = _SCALAR_FORMATS[vtype]
    (value,) = struct.unpack(fmt, f.read(struct.calcsize(fmt)))
    return value


def _read_string_array(f: BinaryIO, count: int) -> list[str]:
    read, unpack = f.read, struct.unpack
    out = []
    for _ in range(count):
        (n,) = unpack("<Q", read(8))
        out.append(read(n).decode("utf-8", errors="replace"))
    return out
