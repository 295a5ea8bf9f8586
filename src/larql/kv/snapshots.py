"""Restoring a saved engine state: build the engine its manifest names (or the one the caller
asks for, which must be the same) for the model, then load the state into it."""

from __future__ import annotations

from pathlib import Path

from larql.inference.engine import Engine
from larql.inference.snapshots import SavedState, SnapshotCorrupt, read_manifest
from larql.kv.catalog import parse_engine
from larql.kv.spec import EngineSpec, EngineSpecError
from larql.models.model import Model


def restore_engine(
    path: str | Path, model: Model, engine: EngineSpec | None = None, profiling: bool = False
) -> tuple[Engine, SavedState]:
    """The engine saved at `path`, its state restored onto `model`. `engine`, where given, must
    be the spec the state was saved with (`SnapshotMismatch` otherwise)."""
    manifest = read_manifest(path)
    if engine is None:
        try:
            engine = parse_engine(manifest.engine_spec or manifest.engine)
        except EngineSpecError as e:
            detail = f"the saved state names an engine larql cannot build: {e}"
            raise SnapshotCorrupt(detail) from None
    built = engine.build(model, profiling=profiling)
    return built, built.load_snapshot(path, model)
