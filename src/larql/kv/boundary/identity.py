"""Who produced a frame: the model's name and architecture, plus revision strings a reader can
compare — the weights' file name with a sampled content hash (size and the first and last MiB of
each weight file: cheap, and different for any real re-export) and a hash of the tokenizer."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from larql.kv.boundary.frames import BoundaryModelIdentity
from larql.models.model import Model

_SAMPLE = 1 << 20
_HASH_CHARS = 12


def _sample_file(digest: Any, path: Path) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        digest.update(f.read(_SAMPLE))
        if size > 2 * _SAMPLE:
            f.seek(size - _SAMPLE)
            digest.update(f.read(_SAMPLE))


def weights_revision(source: Path) -> str:
    """`{file or directory name}@{sampled sha256 prefix}`; `unknown` if it cannot be read."""
    digest = hashlib.sha256()
    try:
        if source.is_dir():
            for path in sorted(source.iterdir()):
                if path.suffix in (".safetensors", ".json", ".gguf") and path.is_file():
                    _sample_file(digest, path)
        else:
            _sample_file(digest, source)
    except OSError:
        return f"{source.name}@unknown"
    return f"{source.name}@{digest.hexdigest()[:_HASH_CHARS]}"


def model_identity(model: Model) -> BoundaryModelIdentity:
    """The identity frames of `model` carry (computed once per loaded model)."""
    key = ("boundary_identity",)
    cached = model.runtime.get(key)
    if isinstance(cached, BoundaryModelIdentity):
        return cached
    vocab = model.tokenizer.tokenizer.to_str().encode()
    identity = BoundaryModelIdentity(
        model_id=model.name,
        model_revision=weights_revision(model.source),
        tokenizer_revision="sha256:" + hashlib.sha256(vocab).hexdigest()[:_HASH_CHARS],
        architecture=model.config.arch.name,
    )
    model.runtime[key] = identity
    return identity
