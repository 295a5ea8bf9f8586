"""`boundary-kv`'s catalog entry."""

from __future__ import annotations

from larql.kv.boundary.archive import DirectoryBoundaryArchive
from larql.kv.boundary.engine import BoundaryKvEngine
from larql.kv.spec import TOKENS, EngineEntry, Sweeps
from larql.kv.standard import WINDOW_DOC
from larql.specs import Param, at_least

ENTRY = EngineEntry(
    name="boundary-kv",
    purpose="standard, boundary frames archived",
    aliases=("boundary",),
    params=(
        Param(
            "chunk_tokens",
            int,
            512,
            "tokens per chunk; a frame at every multiple",
            at_least(1),
            bound=TOKENS,
        ),
        Param(
            "sequence_id",
            str,
            None,
            "sequence the frames belong to, a plain name (none: a fresh id per run; an archive "
            "refuses a sequence another run wrote)",
            kind="name",
        ),
        Param(
            "window",
            int,
            None,
            WINDOW_DOC + " (of the inner standard engine)",
            at_least(1),
            bound=TOKENS,
        ),
        Param("archive", str, None, "directory to write frames to (none = in memory)", kind="path"),
    ),
    keeps="standard K/V; boundary frames (residual, top-1/top-2, int8 agreement) go to the "
    "archive, not the engine's memory",
    contract="exact vs standard (it is standard); a frame at every multiple of chunk_tokens",
    factory=lambda p, model: BoundaryKvEngine(
        chunk_tokens=p["chunk_tokens"],
        sequence_id=p["sequence_id"],
        window=p["window"],
        archive=DirectoryBoundaryArchive(p["archive"]) if p["archive"] else None,
    ),
    sweeps=Sweeps(bench=("chunk_tokens=4",), accuracy=("chunk_tokens=64",), longctx=()),  # exact
)
