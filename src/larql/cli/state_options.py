"""`larql run --save-state DIR` / `--load-state DIR`: prefill a document once, ask many
questions. A saved state is the engine's state after the prompt (see `Engine.snapshot`); a load
restores it — the engine it was saved with, unless `--engine` names that same spec — and the
new prompt's tokens continue it as decode steps (`larql.generate`'s `save_state` /
`load_state`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

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


def describe_state(verb: str, state: SavedState) -> str:
    """One stderr line for a state loaded or saved."""
    manifest = state.manifest
    size = f"{state.nbytes:,} bytes, " if verb == "saved" else ""
    return (
        f"{verb} state: {state.path} ({size}{manifest.position} tokens, "
        f"engine {manifest.engine_spec or manifest.engine})"
    )
