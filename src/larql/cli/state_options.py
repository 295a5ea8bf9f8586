"""`larql run --save-state DIR` / `--load-state DIR`: prefill a document once, ask many
questions. A saved state is the engine's declared state after the prompt (`larql.State`); a
load restores it — the engine it was saved with, unless `--engine` names that same spec — and the
new prompt's tokens continue it as decode steps (`larql.generate`'s `save_state` /
`load_state`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from larql.errors import InvalidInput

if TYPE_CHECKING:
    from larql.inference.snapshots import SavedState

SaveStateOption = Annotated[
    Path | None,
    typer.Option(
        "--save-state",
        help="Write the engine's state after the prompt into DIR (load it with --load-state).",
    ),
]
LoadStateOption = Annotated[
    Path | None,
    typer.Option(
        "--load-state",
        help="Start from the state saved in DIR; the prompt (may be empty) continues it.",
    ),
]

ResumeOption = Annotated[
    str | None,
    typer.Option(
        "--resume",
        help="Continue SEQUENCE of the --engine boundary-kv:archive=DIR archive (as `larql "
        "boundary ls DIR` lists it): its tokens are run again, then the prompt (may be empty).",
        metavar="SEQUENCE",
    ),
]


def check_state_directory(path: Path | None) -> None:
    """Refuse a `--save-state` path that is a file, or under no writable directory (it is
    created with its missing parents, once the prompt is in)."""
    if path is None:
        return
    if path.exists() and not path.is_dir():
        raise InvalidInput(f"--save-state {path} is a file; name a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise InvalidInput(f"--save-state {path}: {existing} is not a writable directory")


def describe_state(verb: str, state: SavedState) -> str:
    """One stderr line for a state loaded or saved."""
    manifest = state.manifest
    size = f"{state.nbytes:,} bytes, " if verb == "saved" else ""
    return (
        f"{verb} state: {state.path} ({size}{manifest.position} tokens, "
        f"engine {manifest.engine_spec or manifest.engine})"
    )
