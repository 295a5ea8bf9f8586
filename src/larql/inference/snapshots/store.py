"""A state on disk: `DIR/manifest.json` (what the state is: engine, model, position, prompt
token ids, the state tree) beside `DIR/state.safetensors` (every tensor of the tree)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from larql.inference.snapshots.errors import SnapshotCorrupt, SnapshotNotFound, SnapshotUnwritable
from larql.models.model import Model

FORMAT = "larql-engine-state/1"
MANIFEST = "manifest.json"
TENSORS = "state.safetensors"
HIDDEN = "hidden"  # the tensor name of the last output row, beside the tree's t0, t1, …
_FINGERPRINT_ROWS = 16


def model_fingerprint(model: Model) -> str:
    """What a state is tied to: the model's name, shape and dtype and a hash of a few of its
    weights (so two revisions under one name differ). Cached on the model."""
    cached = model.runtime.get("state-fingerprint")
    if isinstance(cached, str):
        return cached
    cfg, weights = model.config, model.weights
    digest = hashlib.sha256()
    digest.update(f"{model.name}|{cfg.num_layers}|{cfg.hidden_size}|{model.dtype}".encode())
    for tensor in (weights.embed[:_FINGERPRINT_ROWS], weights.final_norm):
        digest.update(tensor.detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
    fingerprint = digest.hexdigest()[:16]
    model.runtime["state-fingerprint"] = fingerprint
    return fingerprint


@dataclass(frozen=True)
class SnapshotManifest:
    engine: str  # the engine's name
    engine_spec: str  # its canonical spec ("" where it was not built from a spec)
    engine_class: str
    model: str
    model_fingerprint: str
    dtype: str
    position: int  # tokens the state holds
    larql_version: str
    token_ids: list[int] = field(default_factory=list)  # the prompt, where the caller gave it
    state: Any = None  # the encoded state tree
    format: str = FORMAT


def write_snapshot(
    path: str | Path, manifest: SnapshotManifest, tensors: dict[str, torch.Tensor]
) -> int:
    """Write the state into directory `path` (created) → bytes written."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(directory / TENSORS), metadata={"format": FORMAT})
        (directory / MANIFEST).write_text(json.dumps(asdict(manifest)))
    except (OSError, SafetensorError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise SnapshotUnwritable(f"cannot write the state into {directory}: {reason}") from None
    return sum(f.stat().st_size for f in (directory / TENSORS, directory / MANIFEST))


def read_manifest(path: str | Path) -> SnapshotManifest:
    directory = Path(path)
    if not (directory / MANIFEST).is_file():
        raise SnapshotNotFound(f"no saved state at {directory} (expected {MANIFEST} there)")
    try:
        raw = json.loads((directory / MANIFEST).read_text())
        if raw.get("format") != FORMAT:
            raise SnapshotCorrupt(
                f"{directory / MANIFEST} is not a larql state (format {raw.get('format')!r}, "
                f"expected {FORMAT!r})"
            )
        manifest = SnapshotManifest(**raw)
    except (json.JSONDecodeError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise SnapshotCorrupt(
            f"{directory / MANIFEST} does not read as a state manifest: {e}"
        ) from None
    return manifest


def read_snapshot(path: str | Path) -> tuple[SnapshotManifest, dict[str, torch.Tensor]]:
    manifest = read_manifest(path)
    directory = Path(path)
    try:
        tensors = load_file(str(directory / TENSORS))
    except (SafetensorError, OSError) as e:
        raise SnapshotCorrupt(f"{directory / TENSORS} does not read: {e}") from None
    return manifest, tensors
