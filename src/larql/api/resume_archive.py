"""Resuming a sequence a `boundary-kv:archive=DIR` run archived: its frames' token ids run
through a fresh engine again (exact: the frames hold one residual per chunk, not the K/V), the
stored residuals checked against the rebuilt rows, and the result a `State` that `generate`
continues (`larql.resume`, `generate(..., resume=SEQUENCE)`, `larql run --resume`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from larql.api.engine_specs import engine_spec
from larql.api.renamed import renamed_arguments
from larql.errors import InvalidInput
from larql.inference.engine import Engine
from larql.inference.ffn import build_ffn
from larql.inference.prompt import check_context
from larql.kv.boundary.archive import DirectoryBoundaryArchive
from larql.kv.boundary.engine import BoundaryKvEngine
from larql.kv.boundary.resume import archived_sequence, check_residuals
from larql.kv.snapshots import State
from larql.kv.spec import EngineSpec
from larql.models.model import Model


@dataclass(frozen=True)
class Resumed:
    """Where a resumed context came from: the archive, the sequence, how many tokens and frames
    it held, and the largest relative distance between a stored residual and the rebuilt row
    (None: not checked); `continued_as`: the sequence the continuing engine archives to (a
    `boundary-kv:archive=DIR` engine's fresh one, which re-derives the resumed frames first),
    else None."""

    archive: str
    sequence_id: str
    tokens: int
    frames: int
    residual_distance: float | None
    continued_as: str | None = None

    def describe(self) -> str:
        checked = (
            "residuals not checked"
            if self.residual_distance is None
            else f"residuals within {self.residual_distance:.2g}"
        )
        onward = f"; continued as sequence {self.continued_as}" if self.continued_as else ""
        return (
            f"resumed sequence {self.sequence_id} from {self.archive} ({self.tokens} tokens, "
            f"{self.frames} frames, {checked}){onward}"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "archive": self.archive,
            "sequence_id": self.sequence_id,
            "tokens": self.tokens,
            "frames": self.frames,
            "residual_distance": self.residual_distance,
            "continued_as": self.continued_as,
        }


def archive_of(spec: EngineSpec, archive: str | Path | None) -> Path:
    """The archive to read: the one given, else the spec's `archive=` (boundary-kv's)."""
    if archive is not None:
        return Path(archive)
    named = spec.params.get("archive")
    if isinstance(named, str) and named:
        return Path(named)
    raise InvalidInput(
        f"resuming needs a boundary archive to read: an engine boundary-kv:archive=DIR (or "
        f"larql.resume's archive=); the engine {spec.spec()!r} names none"
    )


def archiving(engine: Engine) -> BoundaryKvEngine | None:
    """The engine, where it is a boundary-kv engine writing to a directory archive."""
    if isinstance(engine, BoundaryKvEngine) and isinstance(
        engine.archive, DirectoryBoundaryArchive
    ):
        return engine
    return None


def rebuild(
    model: Model,
    spec: EngineSpec,
    sequence: str,
    *,
    archive: str | Path | None = None,
    ffn: str = "dense",
    verify: bool = True,
) -> tuple[State, Resumed]:
    """A fresh engine of `spec` holding the archived tokens of `sequence` → its `State` (not
    forked: the caller owns the engine) and where it came from."""
    spec.require_live_decode()
    chain = archived_sequence(DirectoryBoundaryArchive(archive_of(spec, archive)), sequence, model)
    ids = chain.token_ids
    check_context(model, len(ids))
    built = spec.build(model)
    onward = archiving(built)
    router = build_ffn(model, ffn)
    try:
        with torch.inference_mode():
            rows = built.prefill_all(model, router, ids)  # [S, H] (or its last rows)
        distance = check_residuals(chain, rows) if verify else None
    except BaseException:
        if onward is not None:  # the frames a refused rebuild wrote are no sequence of anyone's
            onward.archive.discard(onward.sequence_id)
        raise
    finally:
        router.close()
    continued_as = onward.sequence_id if onward is not None else None
    resumed = Resumed(
        chain.archive, sequence, chain.tokens, len(chain.frames), distance, continued_as
    )
    return State(model, built, rows[-1:].clone(), tuple(ids)), resumed


@renamed_arguments(ffn="ffn_policy")
def resume(
    model: Model,
    engine: EngineSpec | str,
    sequence: str,
    *,
    archive: str | Path | None = None,
    ffn_policy: str = "dense",
    verify: bool = True,
) -> State:
    """The context of `sequence`, as a `boundary-kv:archive=DIR` run archived it, rebuilt in a
    fresh engine of `engine` → its `State`: continue it with `generate(model, state, "…")`,
    fork it or save it. The archive is `archive`, else the engine's own `archive=`. The
    archived token ids are run through the engine again (exact; the tokens after the
    sequence's last frame were never archived); `verify` checks each stored residual against
    the rebuilt row at its position (turn it off for an engine that does not compute the
    context as the archiving run did: another window, a lossy prefill)."""
    state, _ = rebuild(
        model, engine_spec(engine), sequence, archive=archive, ffn=ffn_policy, verify=verify
    )
    return state
