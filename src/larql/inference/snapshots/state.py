"""Saving, restoring and forking an engine's state. An engine's state is its attributes
(`Engine.state_dict()`), less the ones it rebuilds from its spec (`_snapshot_exclude`), encoded
by `tree`; restoring sets them on an engine built from the same spec. So an engine gets
snapshots by keeping its state in attributes, and refuses by naming why (`snapshot_refusal`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from larql.inference.snapshots.errors import SnapshotMismatch, SnapshotUnsupported
from larql.inference.snapshots.store import (
    HIDDEN,
    SnapshotManifest,
    model_fingerprint,
    read_snapshot,
    write_snapshot,
)
from larql.inference.snapshots.tree import TreeDecoder, TreeEncoder, Unencodable
from larql.models.model import Model


class Engine(Protocol):
    """What snapshots need of an engine (`larql.inference.engine.Engine` has it)."""

    name: str
    spec_string: str | None
    position: int

    def snapshot_refusal(self, restoring: bool = False) -> str | None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def restored(self, model: Model) -> None: ...


E = TypeVar("E", bound=Engine)


@dataclass(frozen=True)
class SavedState:
    """What a restore hands back beside the engine: the manifest, and the last output row
    [1, H] where it was saved (the next token's logits come from it)."""

    manifest: SnapshotManifest
    hidden: torch.Tensor | None
    path: Path
    nbytes: int = 0


def encoded_state(engine: Engine, encoder: TreeEncoder) -> Any:
    reason = engine.snapshot_refusal()
    if reason is not None:
        raise SnapshotUnsupported(engine.name, reason)
    try:
        return encoder.encode(engine.state_dict(), "engine")
    except Unencodable as e:
        raise SnapshotUnsupported(engine.name, str(e)) from None


def save_state(
    engine: Engine,
    path: str | Path,
    model: Model,
    token_ids: list[int] | None = None,
    hidden: torch.Tensor | None = None,
) -> SavedState:
    encoder = TreeEncoder()
    tree = encoded_state(engine, encoder)
    tensors = dict(encoder.tensors)
    if hidden is not None:
        tensors[HIDDEN] = hidden.detach().to("cpu", copy=True).contiguous()
    cls = type(engine)
    manifest = SnapshotManifest(
        engine=engine.name,
        engine_spec=engine.spec_string or "",
        engine_class=f"{cls.__module__}:{cls.__qualname__}",
        model=model.name,
        model_fingerprint=model_fingerprint(model),
        dtype=str(model.dtype).removeprefix("torch."),
        position=engine.position,
        larql_version=version("larql"),
        token_ids=list(token_ids or []),
        state=tree,
    )
    nbytes = write_snapshot(path, manifest, tensors)
    return SavedState(manifest, hidden, Path(path), nbytes)


def check_compatible(engine: Engine, manifest: SnapshotManifest, model: Model) -> None:
    """Refuse a state saved by another engine (or spec) or for another model."""
    if manifest.engine != engine.name:
        raise SnapshotMismatch(
            f"the state was saved by engine {manifest.engine_spec or manifest.engine!r}; it "
            f"cannot be loaded into {engine.spec_string or engine.name!r}"
        )
    if manifest.engine_spec and engine.spec_string and manifest.engine_spec != engine.spec_string:
        raise SnapshotMismatch(
            f"the state was saved by {manifest.engine_spec!r}, not {engine.spec_string!r}; "
            f"load it with --engine {manifest.engine_spec} (or no --engine)"
        )
    if manifest.model_fingerprint != model_fingerprint(model):
        raise SnapshotMismatch(
            f"the state was saved with model {manifest.model!r} ({manifest.dtype}, fingerprint "
            f"{manifest.model_fingerprint}); this is {model.name!r} "
            f"({str(model.dtype).removeprefix('torch.')}, fingerprint {model_fingerprint(model)})"
        )


def load_state(engine: Engine, path: str | Path, model: Model) -> SavedState:
    manifest, tensors = read_snapshot(path)
    check_compatible(engine, manifest, model)
    reason = engine.snapshot_refusal(restoring=True)
    if reason is not None:
        raise SnapshotUnsupported(engine.name, reason)
    state = TreeDecoder(tensors, model).decode(manifest.state)
    engine.load_state_dict(state)
    engine.restored(model)
    hidden = tensors.get(HIDDEN)
    return SavedState(manifest, None if hidden is None else hidden.to(model.device), Path(path))


def fork_state(engine: E) -> E:
    """An independent copy: the state's tensors copied where they are, everything the engine
    rebuilds from its spec shared."""
    encoder = TreeEncoder(keep_device=True)
    tree = encoded_state(engine, encoder)
    model = encoder.models[0] if encoder.models else None
    clone = copy.copy(engine)
    clone.load_state_dict(TreeDecoder(encoder.tensors, model).decode(tree))
    return clone
