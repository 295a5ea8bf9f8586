"""The typed failures of saving and restoring an engine's state."""

from __future__ import annotations

from larql.errors import LarqlError


class SnapshotError(LarqlError):
    """Base of every snapshot failure; the message says what to change."""


class SnapshotUnsupported(SnapshotError):
    """The engine (or the state it holds right now) cannot be written to disk."""

    def __init__(self, engine: str, reason: str) -> None:
        super().__init__(f"{engine} cannot snapshot its state: {reason}")
        self.engine, self.reason = engine, reason


class SnapshotNotFound(SnapshotError):
    pass


class SnapshotUnwritable(SnapshotError):
    """The directory a state was to be written to cannot be created or written."""


class SnapshotCorrupt(SnapshotError):
    """A manifest or tensor file that does not read back as a larql state."""


class SnapshotMismatch(SnapshotError):
    """A well-formed state saved for another model or another engine."""
