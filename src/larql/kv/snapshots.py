"""A sequence's decode state as one object (`State`: the engine holding it and its last output
row), saved to a directory and loaded back — the engine rebuilt from its spec by the catalog's
parser, never from anything else the file says."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from larql.inference.engine import Engine
from larql.inference.layer import final_logits
from larql.inference.snapshots import (
    SavedState,
    SnapshotCorrupt,
    SnapshotManifest,
    load_state,
    read_snapshot,
    save_state,
)
from larql.kv.catalog import parse_engine
from larql.kv.spec import EngineSpec, EngineSpecError, SpecPolicy
from larql.models.model import Model


@dataclass(frozen=True)
class State:
    """One sequence's decode state on `model`: `engine` holds its `position` tokens
    (`token_ids`, where known), `hidden` [1, H] is the last output row — the next token's
    logits come from it. Decoding from a state goes through a `fork` (`larql.generate` forks
    it), so one state answers any number of continuations."""

    model: Model
    engine: Engine
    hidden: torch.Tensor
    token_ids: tuple[int, ...] = ()

    @property
    def spec(self) -> str:
        """The canonical spec of the engine holding it."""
        return self.engine.spec_string or self.engine.name

    @property
    def position(self) -> int:
        """Tokens the state holds."""
        return self.engine.position

    def logits(self) -> torch.Tensor:
        """The next token's logits [V]."""
        with torch.inference_mode():
            return final_logits(self.model, self.hidden)[0]

    def fork(self) -> State:
        """An independent copy: decoding one leaves the other as it was."""
        with torch.inference_mode():
            engine = self.engine.fork(self.model)
        return State(self.model, engine, self.hidden.clone(), self.token_ids)

    def save(self, path: str | Path) -> SavedState:
        """Write the state into directory `path` (`manifest.json` + `state.safetensors`)."""
        return save_state(self.engine, path, self.model, self.hidden, list(self.token_ids))


def load_state_dir(
    path: str | Path, model: Model, engine: EngineSpec | None = None
) -> tuple[State, SnapshotManifest]:
    """The state saved at `path`, on `model`, and its manifest. The engine is rebuilt from the
    spec the state names (parsed as untrusted input: no path parameters, every size within the
    model's) or from `engine`, which must be that same spec."""
    manifest, tensors = read_snapshot(path)
    spec = engine if engine is not None else _saved_spec(manifest, model)
    built = spec.build(model)
    with torch.inference_mode():
        hidden = load_state(built, manifest, tensors, model)
    return State(model, built, hidden, tuple(manifest.token_ids)), manifest


def _saved_spec(manifest: SnapshotManifest, model: Model) -> EngineSpec:
    """The spec a state names, parsed as a request's would be: it may not name a path or a
    file name, and its sizes must fit the model."""
    try:
        return parse_engine(manifest.engine_spec, SpecPolicy.untrusted(model))
    except EngineSpecError as e:
        raise SnapshotCorrupt(
            f"the state names an engine larql will not build from a file: {e} (give the spec "
            "it was saved with as --engine to load it)"
        ) from None
