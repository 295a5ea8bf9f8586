"""The apollo store: a directory of numpy files that a retrieval engine reads.

    DIR/manifest.json               counts, layers, the model the store was built with
    DIR/boundaries/window_NNN.npy   [H] float32 per window (only when has_residuals)
    DIR/boundary_residual.npy       [H] float32, optional store-wide boundary
    DIR/window_token_lists.npz      members "0", "1", … → uint32 token ids of each window
    DIR/entries.npz                 member "entries": structured array of `ENTRY_DTYPE`

A boundary residual is the **pre-layer residual entering layer `crystal_layer`** (the output of
layer crystal_layer − 1; the scaled embedding when crystal_layer is 0) at the last token of its
window, the window run on its own from position 0. The engine resumes from it by running layers
crystal_layer..L−1, so builder and engine agree on one meaning.

Loading validates every count against the manifest and raises a typed `ApolloStoreError` that
names the file and what is wrong; a store is never half-loaded.
"""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from numpy.lib import format as np_format

from larql.errors import LarqlError

STORE_VERSION = 1
MANIFEST = "manifest.json"
BOUNDARIES_DIR = "boundaries"
BOUNDARY_RESIDUAL = "boundary_residual.npy"
WINDOW_TOKENS = "window_token_lists.npz"
ENTRIES = "entries.npz"
ENTRIES_MEMBER = "entries"

# One injectable fact token. Packed (14 bytes): what the store holds is what `total_bytes` counts.
ENTRY_DTYPE = np.dtype(
    [
        ("token_id", "<u4"),
        ("coefficient", "<f4"),
        ("window_id", "<u2"),
        ("position_in_window", "<u2"),
        ("fact_id", "<u2"),
    ]
)
U16_MAX = np.iinfo(np.uint16).max
_MAX_COUNT = 1 << 40  # a manifest's counts and sizes (nothing sized from them may overflow)


class ApolloStoreError(LarqlError):
    """An apollo store that cannot be used; the message names the store and the problem."""


class StoreNotFound(ApolloStoreError):
    pass


class StoreFormatError(ApolloStoreError):
    """A file is missing, unreadable, or has the wrong dtype or shape."""


class StoreCountMismatch(StoreFormatError):
    """A count in the files disagrees with the manifest (or an id points outside the store)."""


class StoreModelMismatch(ApolloStoreError):
    """The store was built with another model (name or hidden size differ)."""


@dataclass(frozen=True)
class ArchConfig:
    """Layers the store was built for. `retrieval_layer` and `query_head` describe the Rust
    store's attention-based routing; token routing here does not use them."""

    retrieval_layer: int
    query_head: int
    injection_layer: int
    inject_coefficient: float


@dataclass(frozen=True)
class StoreManifest:
    version: int
    model: str
    hidden_size: int
    num_entries: int
    num_windows: int
    num_tokens: int
    entries_per_window: int
    crystal_layer: int
    window_size: int
    arch_config: ArchConfig
    has_residuals: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any, where: Path) -> StoreManifest:
        if not isinstance(raw, dict):
            raise StoreFormatError(f"{where}: the manifest is not a JSON object")
        ints = (
            "version",
            "hidden_size",
            "num_entries",
            "num_windows",
            "num_tokens",
            "entries_per_window",
            "crystal_layer",
            "window_size",
        )
        values: dict[str, Any] = {k: _field(raw, k, int, where) for k in ints}
        if values["version"] != STORE_VERSION:
            raise StoreFormatError(
                f"{where}: store version {values['version']} is not supported "
                f"(this larql reads version {STORE_VERSION})"
            )
        for key in ints[1:]:
            if not 0 <= values[key] <= _MAX_COUNT:
                raise StoreFormatError(
                    f"{where}: {key} must be in 0..{_MAX_COUNT}, got {values[key]}"
                )
        arch = _field(raw, "arch_config", dict, where)
        values["arch_config"] = ArchConfig(
            retrieval_layer=_field(arch, "retrieval_layer", int, where, "arch_config."),
            query_head=_field(arch, "query_head", int, where, "arch_config."),
            injection_layer=_field(arch, "injection_layer", int, where, "arch_config."),
            inject_coefficient=float(
                _field(arch, "inject_coefficient", (int, float), where, "arch_config.")
            ),
        )
        values["model"] = _field(raw, "model", str, where)
        values["has_residuals"] = _field(raw, "has_residuals", bool, where)
        return cls(**values)


def _field(raw: dict, key: str, kind: Any, where: Path, prefix: str = "") -> Any:
    if key not in raw:
        raise StoreFormatError(f"{where}: the manifest has no {prefix}{key}")
    value = raw[key]
    # bool is an int in Python; a count written as true/false is still wrong
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise StoreFormatError(f"{where}: {prefix}{key}={value!r} has the wrong type")
    return value


@dataclass
class ApolloStore:
    """An apollo store in memory.

    boundaries: [num_windows, H] float32 (None without residuals); boundary_residual: [H] or
    None; window_tokens: one uint32 array per window; entries: [num_entries] of ENTRY_DTYPE.
    """

    manifest: StoreManifest
    window_tokens: list[np.ndarray]
    entries: np.ndarray
    boundaries: np.ndarray | None = None
    boundary_residual: np.ndarray | None = None
    path: Path | None = None

    def __post_init__(self) -> None:
        self.validate(self.path or Path("<in memory>"))

    # ------------------------------------------------------------------ accounting

    def total_bytes(self) -> int:
        """boundaries + boundary residual + window tokens + entries, as held in memory."""
        arrays = [self.entries, *self.window_tokens]
        arrays += [a for a in (self.boundaries, self.boundary_residual) if a is not None]
        return sum(int(a.nbytes) for a in arrays)

    def boundary(self, window: int) -> np.ndarray | None:
        """The residual to resume from for `window` ([H]): its own boundary when the store has
        residuals, else the store-wide boundary residual, else None (uncompressed)."""
        if self.boundaries is not None:
            return self.boundaries[window]
        return self.boundary_residual

    # ------------------------------------------------------------------ validation

    def validate(self, where: Path) -> None:
        m = self.manifest
        if len(self.window_tokens) != m.num_windows:
            raise StoreCountMismatch(
                f"{where}: {len(self.window_tokens)} window token lists, manifest says "
                f"num_windows={m.num_windows}"
            )
        for i, tokens in enumerate(self.window_tokens):
            _check_array(tokens, np.uint32, 1, f"{where}: window {i} tokens")
        total = sum(len(t) for t in self.window_tokens)
        if total != m.num_tokens:
            raise StoreCountMismatch(
                f"{where}: the windows hold {total} tokens, manifest says num_tokens={m.num_tokens}"
            )
        if self.entries.dtype != ENTRY_DTYPE or self.entries.ndim != 1:
            raise StoreFormatError(
                f"{where}: entries have dtype {self.entries.dtype} and {self.entries.ndim} dims; "
                f"expected a 1-d array of {ENTRY_DTYPE}"
            )
        if len(self.entries) != m.num_entries:
            raise StoreCountMismatch(
                f"{where}: {len(self.entries)} entries, manifest says num_entries={m.num_entries}"
            )
        self._check_entries(where)
        if m.has_residuals != (self.boundaries is not None):
            state = "has" if self.boundaries is not None else "has no"
            raise StoreCountMismatch(
                f"{where}: the store {state} window boundaries but manifest says "
                f"has_residuals={str(m.has_residuals).lower()}"
            )
        if self.boundaries is not None:
            _check_array(self.boundaries, np.float32, 2, f"{where}: boundaries")
            if self.boundaries.shape != (m.num_windows, m.hidden_size):
                raise StoreCountMismatch(
                    f"{where}: boundaries have shape {tuple(self.boundaries.shape)}, expected "
                    f"({m.num_windows}, {m.hidden_size}) (num_windows, hidden_size)"
                )
        if self.boundary_residual is not None:
            _check_array(self.boundary_residual, np.float32, 1, f"{where}: boundary residual")
            if self.boundary_residual.shape != (m.hidden_size,):
                raise StoreCountMismatch(
                    f"{where}: boundary residual has shape {tuple(self.boundary_residual.shape)}"
                    f", expected ({m.hidden_size},) (hidden_size)"
                )

    def _check_entries(self, where: Path) -> None:
        if len(self.entries) == 0:
            return
        windows = self.entries["window_id"]
        bad = np.flatnonzero(windows >= self.manifest.num_windows)
        if bad.size:
            raise StoreCountMismatch(
                f"{where}: entry {int(bad[0])} has window_id {int(windows[bad[0]])} but the store "
                f"has {self.manifest.num_windows} windows"
            )
        per_window = np.bincount(windows, minlength=self.manifest.num_windows)
        if per_window.max() > self.manifest.entries_per_window:
            w = int(per_window.argmax())
            raise StoreCountMismatch(
                f"{where}: window {w} has {int(per_window[w])} entries, manifest says "
                f"entries_per_window={self.manifest.entries_per_window}"
            )
        lengths = np.array([len(t) for t in self.window_tokens], dtype=np.int64)
        positions = self.entries["position_in_window"].astype(np.int64)
        bad = np.flatnonzero(positions >= lengths[windows])
        if bad.size:
            i = int(bad[0])
            raise StoreCountMismatch(
                f"{where}: entry {i} has position_in_window {int(positions[i])} but window "
                f"{int(windows[i])} holds {int(lengths[windows[i]])} tokens"
            )

    def check_model(self, model_name: str, hidden_size: int, num_layers: int) -> None:
        """Refuse a model the store was not built with, or too shallow for its crystal layer."""
        m = self.manifest
        where = self.path or "apollo store"
        if m.model != model_name or m.hidden_size != hidden_size:
            raise StoreModelMismatch(
                f"{where} was built with {m.model} (hidden {m.hidden_size}); it cannot be used "
                f"with {model_name} (hidden {hidden_size})"
            )
        if m.crystal_layer >= num_layers:
            raise StoreModelMismatch(
                f"{where}: crystal_layer {m.crystal_layer} is outside {model_name}'s "
                f"{num_layers} layers"
            )

    # ------------------------------------------------------------------ files

    def save(self, directory: Path | str) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / MANIFEST).write_text(json.dumps(self.manifest.to_json(), indent=2) + "\n")
        if self.boundaries is not None:
            (directory / BOUNDARIES_DIR).mkdir(exist_ok=True)
            for i, row in enumerate(self.boundaries):
                np.save(directory / BOUNDARIES_DIR / boundary_file(i), row)
        if self.boundary_residual is not None:
            np.save(directory / BOUNDARY_RESIDUAL, self.boundary_residual)
        np.savez(directory / WINDOW_TOKENS, **{str(i): t for i, t in enumerate(self.window_tokens)})
        np.savez(directory / ENTRIES, **{ENTRIES_MEMBER: self.entries})
        self.path = directory
        return directory

    @classmethod
    def load(cls, directory: Path | str) -> ApolloStore:
        directory = Path(directory)
        manifest_file = directory / MANIFEST
        if not directory.is_dir():
            raise StoreNotFound(f"apollo store {directory} does not exist (or is not a directory)")
        if not manifest_file.is_file():
            raise StoreNotFound(f"{directory} is not an apollo store: it has no {MANIFEST}")
        try:
            raw = json.loads(manifest_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StoreFormatError(f"{manifest_file}: not readable JSON ({e})") from None
        manifest = StoreManifest.from_json(raw, manifest_file)
        boundaries = None
        if manifest.has_residuals:
            rows = [
                _load_npy(directory / BOUNDARIES_DIR / boundary_file(i))
                for i in range(manifest.num_windows)
            ]
            for i, row in enumerate(rows):
                _check_array(row, np.float32, 1, f"{directory}: boundary of window {i}")
            extra = _extra_boundary_files(directory, manifest.num_windows)
            if extra:
                raise StoreCountMismatch(
                    f"{directory}: {BOUNDARIES_DIR}/{extra[0]} is beyond num_windows="
                    f"{manifest.num_windows}"
                )
            if len({row.shape for row in rows}) > 1:
                raise StoreCountMismatch(f"{directory}: window boundaries differ in shape")
            width = rows[0].shape[0] if rows else manifest.hidden_size
            boundaries = np.stack(rows) if rows else np.zeros((0, width), np.float32)
        residual_file = directory / BOUNDARY_RESIDUAL
        residual = _load_npy(residual_file) if residual_file.exists() else None
        tokens = _load_npz(directory / WINDOW_TOKENS)
        expected = [str(i) for i in range(len(tokens))]
        if sorted(tokens, key=_member_order) != expected:
            raise StoreFormatError(
                f"{directory / WINDOW_TOKENS}: members must be named 0..{len(tokens) - 1}, got "
                f"{sorted(tokens, key=_member_order)[:5]}…"
            )
        entries_npz = _load_npz(directory / ENTRIES)
        if ENTRIES_MEMBER not in entries_npz:
            raise StoreFormatError(f"{directory / ENTRIES}: no member {ENTRIES_MEMBER!r}")
        return cls(
            manifest=manifest,
            window_tokens=[tokens[k] for k in expected],
            entries=entries_npz[ENTRIES_MEMBER],
            boundaries=boundaries,
            boundary_residual=residual,
            path=directory,
        )


def boundary_file(window: int) -> str:
    return f"window_{window:03d}.npy"


def _member_order(name: str) -> tuple[int, str]:
    return (int(name), name) if name.isdigit() else (1 << 62, name)


def _extra_boundary_files(directory: Path, num_windows: int) -> list[str]:
    known = {boundary_file(i) for i in range(num_windows)}
    folder = directory / BOUNDARIES_DIR
    return sorted(p.name for p in folder.glob("window_*.npy") if p.name not in known)


def _load_npy(path: Path) -> np.ndarray:
    if not path.is_file():
        raise StoreFormatError(f"{path} is missing")
    try:
        with open(path, "rb") as f:
            _check_npy_header(f, path.stat().st_size)
            f.seek(0)
            return np.load(f, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise StoreFormatError(f"{path}: not a readable .npy file ({e})") from None


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise StoreFormatError(f"{path} is missing")
    try:
        _check_npz_headers(path)
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise StoreFormatError(f"{path}: not a readable .npz file ({e})") from None


# the most a deflate stream expands (zlib's bound): an .npz member cannot hold more than this
# times its compressed bytes
_DEFLATE_RATIO = 1032


def _check_npy_header(f: BinaryIO, available: int) -> None:
    """The array an .npy header declares must fit in the `available` bytes it came with: a
    crafted shape is refused before numpy allocates it."""
    version = np_format.read_magic(f)
    if version == (1, 0):
        shape, _, dtype = np_format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, _, dtype = np_format.read_array_header_2_0(f)
    else:
        raise ValueError(f".npy format version {version} is not supported (1.0 or 2.0)")
    needed = math.prod(shape) * dtype.itemsize
    if needed > available - f.tell():
        raise ValueError(
            f"the header declares {dtype} {shape} ({needed} bytes) but only "
            f"{available - f.tell()} bytes follow it"
        )


def _check_npz_headers(path: Path) -> None:
    """Every member of an .npz is an .npy whose declared array fits in what the member can
    hold (its stored bytes, at most the deflate bound of them)."""
    size = path.stat().st_size
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                raise ValueError(f"member {info.filename!r} is not an .npy array")
            stored = info.compress_type == zipfile.ZIP_STORED
            bound = info.compress_size * (1 if stored else _DEFLATE_RATIO)
            if info.compress_size > size or info.file_size > bound:
                raise ValueError(f"member {info.filename!r} declares more bytes than it holds")
            with archive.open(info) as member:
                _check_npy_header(member, info.file_size)  # type: ignore[arg-type]


def _check_array(array: np.ndarray, dtype: type, ndim: int, what: str) -> None:
    if array.dtype != np.dtype(dtype) or array.ndim != ndim:
        raise StoreFormatError(
            f"{what}: dtype {array.dtype} with {array.ndim} dims; expected {np.dtype(dtype)} "
            f"with {ndim}"
        )
