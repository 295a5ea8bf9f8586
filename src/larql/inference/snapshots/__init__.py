"""Engine state snapshots: an engine's declared state (named tensors and typed plain fields)
written to a directory, read back into an engine built from the same spec for the same model,
or forked in memory."""

from larql.inference.snapshots.errors import (
    SnapshotCorrupt,
    SnapshotError,
    SnapshotMismatch,
    SnapshotNotFound,
    SnapshotUnsupported,
    SnapshotUnwritable,
)
from larql.inference.snapshots.schema import StateReader, StateWriter
from larql.inference.snapshots.state import (
    SavedState,
    declared_state,
    fork_state,
    load_state,
    restore_into,
    save_state,
)
from larql.inference.snapshots.store import (
    SnapshotManifest,
    model_fingerprint,
    read_manifest,
    read_snapshot,
)

__all__ = [
    "SavedState",
    "SnapshotCorrupt",
    "SnapshotError",
    "SnapshotManifest",
    "SnapshotMismatch",
    "SnapshotNotFound",
    "SnapshotUnsupported",
    "SnapshotUnwritable",
    "StateReader",
    "StateWriter",
    "declared_state",
    "fork_state",
    "load_state",
    "model_fingerprint",
    "read_manifest",
    "read_snapshot",
    "restore_into",
    "save_state",
]
