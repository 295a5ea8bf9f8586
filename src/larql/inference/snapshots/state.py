"""Saving, restoring and forking an engine's state.

An engine declares its state (`Engine.write_state` / `Engine.read_state`: named tensors and
typed plain fields, see `schema`); restoring builds the engine from its spec through its
constructor — the caller does that, through the catalog — and then reads the declared state
into it, checking every field and tensor against what the spec and the model imply. An engine
that cannot save its state now says why (`snapshot_refusal`); one that declares no state cannot
be saved at all.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import ClassVar, Protocol, TypeVar

import torch

from larql.inference.snapshots.errors import SnapshotCorrupt, SnapshotMismatch, SnapshotUnsupported
from larql.inference.snapshots.schema import StateReader, StateWriter
from larql.inference.snapshots.store import (
    ENGINE_PREFIX,
    HIDDEN,
    SnapshotManifest,
    model_fingerprint,
    write_snapshot,
)
from larql.models.model import Model


class Engine(Protocol):
    """What states need of an engine (`larql.inference.engine.Engine` has it)."""

    name: ClassVar[str]
    STATE_VERSION: ClassVar[int]
    spec_string: str | None
    position: int

    @property
    def prefilled(self) -> bool: ...

    def snapshot_refusal(self) -> str | None: ...

    def prompt_part_way(self) -> bool: ...

    def finish_prompt(self, rows: int) -> bool: ...

    def write_state(self, state: StateWriter) -> None: ...

    def read_state(self, state: StateReader, model: Model) -> None: ...

    def restored(self, model: Model) -> None: ...


E = TypeVar("E", bound=Engine)


@dataclass(frozen=True)
class SavedState:
    """A state on disk: its manifest, the last output row [1, H] (the next token's logits come
    from it), where it is and how many bytes it took."""

    manifest: SnapshotManifest
    hidden: torch.Tensor
    path: Path
    nbytes: int = 0


def declared_state(engine: Engine, keep_device: bool = False) -> StateWriter:
    """The engine's state as fields and tensors; `SnapshotUnsupported` where it cannot give it."""
    reason = engine.snapshot_refusal()
    if reason is None and not engine.prefilled:
        reason = "it holds no prompt yet"
    if reason is None and engine.prompt_part_way():
        reason = "its prompt is still going in, a part at a time"
    if reason is not None:
        raise SnapshotUnsupported(engine.name, reason)
    engine.finish_prompt(sys.maxsize)  # the work its policy does on a whole prompt, all of it
    writer = StateWriter(keep_device)
    engine.write_state(writer)
    return writer


def save_state(
    engine: Engine,
    path: str | Path,
    model: Model,
    hidden: torch.Tensor,
    token_ids: list[int] | None = None,
) -> SavedState:
    """Write the engine's state, its last output row `hidden` [1, H] and the tokens it holds
    (where known) into directory `path`."""
    if not engine.spec_string:
        raise SnapshotUnsupported(
            engine.name,
            "it was not built from a spec (larql.parse_engine(...)), so nothing "
            "could rebuild it from the state",
        )
    state = declared_state(engine)
    tensors = {ENGINE_PREFIX + name: t for name, t in state.tensors.items()}
    row = hidden.detach().to("cpu", copy=True).contiguous()
    tensors[HIDDEN] = row
    manifest = SnapshotManifest(
        engine=engine.name,
        engine_spec=engine.spec_string,
        state_version=engine.STATE_VERSION,
        model=model.name,
        model_fingerprint=model_fingerprint(model),
        dtype=str(model.dtype).removeprefix("torch."),
        position=engine.position,
        larql_version=_larql_version(),
        token_ids=list(token_ids or []),
        fields=dict(state.fields),
    )
    written, nbytes = write_snapshot(path, manifest, tensors)
    return SavedState(written, hidden, Path(path), nbytes)


def check_compatible(engine: Engine, manifest: SnapshotManifest, model: Model) -> None:
    """Refuse a state saved by another engine (or spec, or version of its state) or for another
    model."""
    if manifest.engine != engine.name:
        raise SnapshotMismatch(
            f"the state was saved by engine {manifest.engine_spec or manifest.engine!r}; it "
            f"cannot be loaded into {engine.spec_string or engine.name!r}"
        )
    if engine.spec_string and manifest.engine_spec != engine.spec_string:
        raise SnapshotMismatch(
            f"the state was saved by {manifest.engine_spec!r}, not {engine.spec_string!r}; "
            f"load it with --engine {manifest.engine_spec} (or no --engine)"
        )
    if manifest.state_version != engine.STATE_VERSION:
        raise SnapshotMismatch(
            f"the state holds version {manifest.state_version} of {engine.name}'s state; this "
            f"larql reads version {engine.STATE_VERSION}: save it again with this version"
        )
    if manifest.model_fingerprint != model_fingerprint(model):
        raise SnapshotMismatch(
            f"the state was saved with model {manifest.model!r} ({manifest.dtype}, fingerprint "
            f"{manifest.model_fingerprint}); this is {model.name!r} "
            f"({str(model.dtype).removeprefix('torch.')}, fingerprint {model_fingerprint(model)})"
        )


def load_state(
    engine: Engine, manifest: SnapshotManifest, tensors: dict[str, torch.Tensor], model: Model
) -> torch.Tensor:
    """Read a state (as `store.read_snapshot` gives it) into `engine`, freshly built from the
    state's spec → the last output row [1, H] on the model's device."""
    check_compatible(engine, manifest, model)
    cfg = model.config
    if not 1 <= manifest.position <= cfg.max_positions:
        raise SnapshotCorrupt(
            f"the state holds {manifest.position} tokens; {model.name} holds 1..{cfg.max_positions}"
        )
    ids = manifest.token_ids
    if len(ids) > manifest.position or any(t >= cfg.vocab_size for t in ids):
        raise SnapshotCorrupt(
            f"the state's token_ids must be at most {manifest.position} ids below {cfg.vocab_size}"
        )
    own = {
        name.removeprefix(ENGINE_PREFIX): t
        for name, t in tensors.items()
        if name.startswith(ENGINE_PREFIX)
    }
    extra = sorted(set(tensors) - {HIDDEN} - {ENGINE_PREFIX + name for name in own})
    if extra:
        raise SnapshotCorrupt(f"the state holds tensor {extra[0]!r}, which no state has")
    hidden = StateReader({}, tensors, model.device).tensor(
        HIDDEN, model.dtype, (1, cfg.hidden_size)
    )
    reader = StateReader(manifest.fields, own, model.device)
    restore_into(engine, reader, model, manifest.position)
    reader.finish()
    return hidden


def restore_into(engine: Engine, reader: StateReader, model: Model, position: int) -> None:
    """Give `engine` (built from its spec, nothing prefilled) the state `reader` holds at
    `position` tokens."""
    engine.position = position
    engine.read_state(reader, model)
    engine.restored(model)


def fork_state(
    engine: E, model: Model, state: StateWriter | None = None, position: int | None = None
) -> E:
    """An independent copy: the state's tensors copied where they are, everything the engine
    rebuilds from its spec shared. `state` and `position`: a state the engine wrote of its
    first `position` tokens (kept on its device), taken instead of its whole one."""
    if state is None:
        state = declared_state(engine, keep_device=True)
    clone = copy.copy(engine)
    reader = StateReader(state.fields, state.tensors, model.device)
    restore_into(clone, reader, model, engine.position if position is None else position)
    reader.finish()
    return clone


def _larql_version() -> str:
    """The installed package's version; where larql runs from a source folder no installer
    recorded, says so (the version is a label in the manifest, never checked on load)."""
    try:
        return version("larql")
    except PackageNotFoundError:
        return "source tree (not installed)"
