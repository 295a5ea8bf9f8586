"""A state on disk: `DIR/manifest.json` (what the state is: the engine spec and its state
version, the model, the position, the prompt's token ids, the engine's plain fields) beside
`DIR/state.safetensors` (the engine's named tensors and the last output row).

Both are untrusted input when read. The manifest is plain JSON of a fixed shape, every entry
type-checked; it carries the SHA-256 of the tensor file and a digest of itself, so a state
damaged or edited in transit is refused in one line instead of restoring something else. (The
digest is not a signature: whoever edits a state on purpose can recompute it — what keeps such
a file harmless is that nothing in it is code, and that every value is checked on the way in.)
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from larql.inference.snapshots.errors import SnapshotCorrupt, SnapshotNotFound, SnapshotUnwritable
from larql.models.model import Model

FORMAT = "larql-engine-state/2"
OLD_FORMATS = ("larql-engine-state/1",)
MANIFEST = "manifest.json"
TENSORS = "state.safetensors"
HIDDEN = "hidden"  # the tensor name of the last output row, beside the engine's own
ENGINE_PREFIX = "engine."  # the engine's tensors are named under it
MAX_MANIFEST_BYTES = 64 << 20
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
    engine_spec: str  # its canonical spec, parsed by the catalog to rebuild it
    state_version: int  # the version of the engine's declared state
    model: str
    model_fingerprint: str
    dtype: str
    position: int  # tokens the state holds
    larql_version: str
    token_ids: list[int] = field(default_factory=list)  # the tokens, where the caller gave them
    fields: dict[str, Any] = field(default_factory=dict)  # the engine's plain fields
    tensors_sha256: str = ""
    format: str = FORMAT


# each manifest entry's JSON type (an `int` entry takes no boolean)
_JSON_TYPES = {
    "engine": str,
    "engine_spec": str,
    "state_version": int,
    "model": str,
    "model_fingerprint": str,
    "dtype": str,
    "position": int,
    "larql_version": str,
    "token_ids": list,
    "fields": dict,
    "tensors_sha256": str,
    "format": str,
}
DIGEST = "digest"


def _canonical(document: dict[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def manifest_digest(document: dict[str, Any]) -> str:
    """The digest a manifest carries: the SHA-256 of its other entries, as canonical JSON."""
    return hashlib.sha256(_canonical(document)).hexdigest()


def write_snapshot(
    path: str | Path, manifest: SnapshotManifest, tensors: dict[str, torch.Tensor]
) -> tuple[SnapshotManifest, int]:
    """Write the state into directory `path` (created) → the manifest as written (with the
    tensors' hash) and the bytes written. The manifest goes last, through a rename, so a
    directory never holds a manifest for other tensors."""
    directory = Path(path)
    data = save_tensors(tensors, metadata={"format": FORMAT})
    written = SnapshotManifest(**{**asdict(manifest), "tensors_sha256": _sha256(data)})
    document = asdict(written)
    text = json.dumps({**document, DIGEST: manifest_digest(document)})
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / MANIFEST).unlink(missing_ok=True)
        (directory / TENSORS).write_bytes(data)
        partial = directory / f".{MANIFEST}.partial"
        partial.write_text(text)
        os.replace(partial, directory / MANIFEST)
    except OSError as e:
        reason = e.strerror or e
        raise SnapshotUnwritable(f"cannot write the state into {directory}: {reason}") from None
    return written, len(data) + len(text.encode())


def read_manifest(path: str | Path) -> SnapshotManifest:
    """The manifest at `path`, every entry type-checked and its digest verified."""
    directory = Path(path)
    where = directory / MANIFEST
    if not where.is_file():
        raise SnapshotNotFound(f"no saved state at {directory} (expected {MANIFEST} there)")
    try:
        size = where.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise SnapshotCorrupt(
                f"{where} is {size} bytes; a state manifest is at most {MAX_MANIFEST_BYTES}"
            )
        raw = json.loads(where.read_bytes())
    except (ValueError, RecursionError) as e:  # (JSONDecodeError, UnicodeDecodeError)
        raise SnapshotCorrupt(f"{where} does not read as JSON: {str(e)[:120]}") from None
    except OSError as e:
        raise SnapshotCorrupt(f"{where} cannot be read: {e.strerror or e}") from None
    return _checked_manifest(raw, where)


def _checked_manifest(raw: Any, where: Path) -> SnapshotManifest:
    if not isinstance(raw, dict):
        raise SnapshotCorrupt(f"{where} is not a larql state manifest (not a JSON object)")
    stated = raw.get("format")
    if stated in OLD_FORMATS:
        raise SnapshotCorrupt(
            f"{where} was saved by an older larql (format {stated!r}, whose states could name "
            "code to run on load); it is not read: save the state again with this version"
        )
    if stated != FORMAT:
        shown = repr(stated)[:60]
        raise SnapshotCorrupt(f"{where} is not a larql state (format {shown}, expected {FORMAT!r})")
    document = {k: v for k, v in raw.items() if k != DIGEST}
    unknown = sorted(set(document) - set(_JSON_TYPES))
    missing = sorted(set(_JSON_TYPES) - set(document))
    if unknown or missing:
        what = f"unknown entry {unknown[0]!r}" if unknown else f"no entry {missing[0]!r}"
        raise SnapshotCorrupt(f"{where} has {what}")
    for name, kind in _JSON_TYPES.items():
        value = document[name]
        if type(value) is not kind:
            found = type(value).__name__
            raise SnapshotCorrupt(f"{where}: {name} is a {found}, not a {kind.__name__}")
    try:
        expected = manifest_digest(document)
    except ValueError:  # a NaN or an infinity: JSON has no such number
        raise SnapshotCorrupt(f"{where} holds a number JSON cannot hold") from None
    if raw.get(DIGEST) != expected:
        raise SnapshotCorrupt(
            f"{where} does not match its digest: the state was changed or damaged after it "
            "was saved"
        )
    if any(type(t) is not int or t < 0 for t in document["token_ids"]):
        raise SnapshotCorrupt(f"{where}: token_ids must be a list of non-negative integers")
    return SnapshotManifest(**document)


def read_snapshot(path: str | Path) -> tuple[SnapshotManifest, dict[str, torch.Tensor]]:
    """The manifest and the tensors it was saved with (their hash checked)."""
    manifest = read_manifest(path)
    where = Path(path) / TENSORS
    try:
        data = where.read_bytes()
    except OSError as e:
        raise SnapshotCorrupt(f"{where} cannot be read: {e.strerror or e}") from None
    if _sha256(data) != manifest.tensors_sha256:
        raise SnapshotCorrupt(
            f"{where} is not the tensor file its manifest was saved with (changed or damaged)"
        )
    try:
        tensors = load_tensors(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise SnapshotCorrupt(f"{where} does not read as safetensors: {str(e)[:120]}") from None
    return manifest, tensors


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
