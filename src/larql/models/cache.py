"""The user cache: dequantized GGUF weights (safetensors) and built tokenizers (tokenizer.json),
keyed by the source file's content hash, so a second load skips dequantization (SmolLM2: ~3 s
→ well under 2 s).

Location: `$LARQL_CACHE_DIR`, else `$XDG_CACHE_HOME/larql`, else `~/.cache/larql`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

_HASH_CHUNK = 1 << 22
CACHE_FORMAT = "v1"  # bump when the canonical layout changes


def cache_dir() -> Path:
    explicit = os.environ.get("LARQL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "larql"


# What larql writes under the cache directory, each rebuilt when next needed; `larql cache
# clear` removes these and nothing else (LARQL_CACHE_DIR may name a directory shared with more)
CACHE_PARTS = {
    "weights": "dequantised GGUF weights, float32 (rebuilt at the next load of that model)",
    "tokenizers": "tokenizers built from GGUF files",
    "digests": "content hashes of model files, by path, size and time",
    "gemma3-270m": "the Gemma 3 GGUF, assembled from its package",
}


def tree_bytes(path: Path) -> int:
    """The bytes of the files under `path` (a file: its own); 0 if it is missing."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += (Path(root) / name).lstat().st_size
    return total


def cache_usage() -> dict[str, int]:
    """The bytes of each part of the cache that exists."""
    root = cache_dir()
    return {part: tree_bytes(root / part) for part in CACHE_PARTS if (root / part).exists()}


def clear_cache() -> dict[str, int]:
    """Remove every part of the cache; the bytes each held."""
    import shutil

    root = cache_dir()
    removed = cache_usage()
    for part in removed:
        shutil.rmtree(root / part, ignore_errors=True)
    return removed


def file_digest(path: Path) -> str:
    """sha256 of the file, memoised next to the cache by (path, size, mtime)."""
    stat = path.stat()
    memo = (
        cache_dir()
        / "digests"
        / hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    )
    if memo.exists():
        return memo.read_text().strip()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_CHUNK):
            h.update(block)
    digest = h.hexdigest()
    _write_atomic(memo, lambda tmp: tmp.write_text(digest))
    return digest


def cached_state_dict(
    source: Path, build: Callable[[], dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The canonical float32 state of `source`, built once and then read from the cache."""
    target = cache_dir() / "weights" / f"{file_digest(source)}-{CACHE_FORMAT}.safetensors"
    if target.exists():
        try:
            return load_file(target)
        except Exception:  # a truncated or foreign file: rebuild it
            target.unlink(missing_ok=True)
    state = build()
    with contextlib.suppress(OSError):  # a read-only or full cache must not stop the load
        _write_atomic(target, lambda tmp: save_file(state, str(tmp)))
    return state


def cached_tokenizer(source: Path, build: Callable[[], Tokenizer]) -> Tokenizer:
    target = cache_dir() / "tokenizers" / f"{file_digest(source)}-{CACHE_FORMAT}.json"
    if target.exists():
        try:
            return Tokenizer.from_file(str(target))
        except Exception:
            target.unlink(missing_ok=True)
    tokenizer = build()
    with contextlib.suppress(OSError):
        _write_atomic(target, lambda tmp: tokenizer.save(str(tmp)))
    return tokenizer


def _write_atomic(target: Path, write: Callable[[Path], object]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
