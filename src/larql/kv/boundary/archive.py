"""Where boundary frames go: an in-memory archive (the default, gone with the process) and a
directory archive that a later process can load and list.

Directory layout: one file per frame, `{sequence}.{token_end:012d}.boundary.safetensors`, holding
the payload bytes as a uint8 tensor named `payload` and the frame's JSON metadata document in the
safetensors header under `larql_boundary_frame` — readable with any safetensors loader. A frame
written again under the same sequence and token_end replaces the old one (in memory too); the
engine never lets a second run write into a sequence that is already there (a fresh sequence id
per run by default), so a chain is always one run's, and each frame records the run that wrote
it. Writes go to a temporary file that is then renamed, so a reader never sees half a frame.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from larql.errors import LarqlError
from larql.kv.boundary.frames import BoundaryFormatError, BoundaryFrame

FRAME_SUFFIX = ".boundary.safetensors"
METADATA_KEY = "larql_boundary_frame"


class BoundaryArchiveError(LarqlError):
    """The archive could not store or read frames (I/O, a path that is not a directory)."""


class BoundaryArchive(ABC):
    @abstractmethod
    def append(self, frame: BoundaryFrame) -> None: ...

    @abstractmethod
    def frames(self) -> list[BoundaryFrame]:
        """Every frame, ordered by sequence then token_end."""

    @abstractmethod
    def describe(self) -> str: ...

    def exists(self) -> bool:
        """Whether there is anything to read yet."""
        return True

    def discard(self, sequence_id: str) -> None:
        """Remove every frame of one sequence (a run that was refused before it was done)."""
        raise BoundaryArchiveError(f"{self.describe()} cannot remove frames")

    def load_chain(self, sequence_id: str) -> list[BoundaryFrame]:
        """The frames of one sequence in token order."""
        return [f for f in self.frames() if f.sequence_id == sequence_id]

    def sequences(self) -> list[str]:
        return sorted({f.sequence_id for f in self.frames()})

    def total_frames(self) -> int:
        return len(self.frames())

    def payload_bytes(self) -> int:
        return sum(f.payload.nbytes for f in self.frames())


def _order(frame: BoundaryFrame) -> tuple[str, int]:
    return frame.sequence_id, frame.token_end


class InMemoryBoundaryArchive(BoundaryArchive):
    def __init__(self) -> None:
        self._frames: dict[tuple[str, int], BoundaryFrame] = {}

    def append(self, frame: BoundaryFrame) -> None:
        self._frames[_order(frame)] = frame

    def frames(self) -> list[BoundaryFrame]:
        return [self._frames[key] for key in sorted(self._frames)]

    def total_frames(self) -> int:
        return len(self._frames)

    def discard(self, sequence_id: str) -> None:
        for key in [key for key in self._frames if key[0] == sequence_id]:
            del self._frames[key]

    def describe(self) -> str:
        return "in-memory"


def frame_file_name(sequence_id: str, token_end: int) -> str:
    """A file-system-safe name; sequence ids with other characters get a short hash so two ids
    never share a name."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", sequence_id)
    if safe != sequence_id or not safe:
        safe += "-" + hashlib.sha256(sequence_id.encode()).hexdigest()[:8]
    return f"{safe}.{token_end:012d}{FRAME_SUFFIX}"


class DirectoryBoundaryArchive(BoundaryArchive):
    """Frames as files under `root` (created on the first append)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def append(self, frame: BoundaryFrame) -> None:
        path = self.root / frame_file_name(frame.sequence_id, frame.token_end)
        tmp = path.with_name(path.name + ".tmp")
        payload = torch.from_numpy(np.frombuffer(frame.payload.data, dtype=np.uint8).copy())
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            save_file(
                {"payload": payload},
                str(tmp),
                metadata={METADATA_KEY: json.dumps(frame.to_json())},
            )
            os.replace(tmp, path)
        except (OSError, SafetensorError) as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise BoundaryArchiveError(f"cannot write {path}: {e}") from e

    def frames(self) -> list[BoundaryFrame]:
        if not self.root.exists():
            raise BoundaryArchiveError(f"no boundary archive at {self.root}")
        if not self.root.is_dir():
            raise BoundaryArchiveError(f"{self.root} is not a directory")
        frames = [load_frame(p) for p in sorted(self.root.glob(f"*{FRAME_SUFFIX}"))]
        return sorted(frames, key=_order)

    def discard(self, sequence_id: str) -> None:
        stem = frame_file_name(sequence_id, 0).split(".")[0]  # unique to the id (hashed if odd)
        try:
            for path in self.root.glob(f"{stem}.*{FRAME_SUFFIX}"):
                path.unlink(missing_ok=True)
        except OSError as e:
            raise BoundaryArchiveError(f"cannot remove sequence {sequence_id!r}: {e}") from e

    def describe(self) -> str:
        return str(self.root)

    def exists(self) -> bool:
        return self.root.exists()


def load_frame(path: Path) -> BoundaryFrame:
    """One frame file; anything wrong with it is a `BoundaryFormatError` naming the file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            header = (f.metadata() or {}).get(METADATA_KEY)
            if "payload" not in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                raise BoundaryFormatError(f"{path} has no payload tensor")
            payload = f.get_tensor("payload")
    except (OSError, SafetensorError) as e:
        raise BoundaryFormatError(f"{path} is not a readable boundary frame: {e}") from None
    if header is None:
        raise BoundaryFormatError(f"{path} has no {METADATA_KEY} metadata")
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise BoundaryFormatError(
            f"{path}: the payload is {payload.dtype} {tuple(payload.shape)}, not 1-d uint8 bytes"
        )
    try:
        doc = json.loads(header)
    except (ValueError, RecursionError) as e:
        raise BoundaryFormatError(f"{path}: metadata is not JSON: {e}") from None
    try:
        return BoundaryFrame.from_json(doc, payload.numpy().tobytes())
    except BoundaryFormatError as e:
        raise BoundaryFormatError(f"{path}: {e}") from None
