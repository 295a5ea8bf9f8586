"""Engine state snapshots: write an engine's state to a directory, restore it into an engine
built from the same spec for the same model, or fork it in memory."""

from larql.inference.snapshots.errors import (
    SnapshotCorrupt,
    SnapshotError,
    SnapshotMismatch,
    SnapshotNotFound,
    SnapshotUnsupported,
    SnapshotUnwritable,
)
from larql.inference.snapshots.state import SavedState, fork_state, load_state, save_state
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
    "fork_state",
    "load_state",
    "model_fingerprint",
    "read_manifest",
    "read_snapshot",
    "save_state",
]
