"""Reading an archived sequence back: the chain of frames `boundary-kv` wrote for one sequence,
checked as untrusted input, and the check of a rebuilt context against the residuals stored in it.

What can be rebuilt exactly, and how: a frame holds one residual (the last layer's output at its
chunk's last position) and, from frame version 3, its chunk's token ids. One residual per chunk
cannot give back the K/V of every position and layer, so the context is rebuilt by running the
archived token ids through the model again (the frames' `cold_replay`): exact, up to the order of
float sums. The stored residuals then check the rebuild — each must match the rebuilt row at its
position within its codec's error — which catches an archive of another model, dtype or window,
or token ids changed after the frames were written. The tokens after a sequence's last frame were
never framed: a rebuild holds the tokens up to the last frame's `token_end`."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from larql.kv.boundary import codecs
from larql.kv.boundary.archive import BoundaryArchive, BoundaryArchiveError
from larql.kv.boundary.frames import TOKEN_IDS_SINCE, BoundaryFrame
from larql.kv.boundary.identity import model_identity
from larql.models.model import Model

# relative L2 distance a stored residual may be from the rebuilt row: bf16 rounds each element by
# at most 2⁻⁹ relative (≤ 0.2% of the row), int8_clip3sigma by half a step of 3σ/127 (≈ 0.7%),
# compared after clipping the rebuilt row as the codec clipped the stored one
RESIDUAL_TOLERANCE = {"bf16": 0.02, "int8_clip3sigma": 0.05}
NAMES_SHOWN = 8
_PLAIN = re.compile(r"[\w.:@+/-]{1,120}")


def shown(text: str) -> str:
    """A string read from an archive file, safe in a one-line message: as it is where plain,
    else escaped and cut (no line breaks, no brackets a terminal renderer would take as markup)."""
    if _PLAIN.fullmatch(text):
        return text
    return ascii(text[:60]).replace("[", "(").replace("]", ")")


class ArchiveResumeError(BoundaryArchiveError):
    """An archived sequence that cannot be resumed on this model."""


class UnknownSequence(ArchiveResumeError):
    """The archive holds no frames of the sequence asked for."""


class NotResumable(ArchiveResumeError):
    """The sequence's frames do not hold a whole context (old frames without token ids, a gap,
    ids the model does not have)."""


class ArchiveMismatch(ArchiveResumeError):
    """The frames were written by another model, or the rebuilt context does not reproduce the
    residuals stored in them."""


@dataclass(frozen=True)
class ArchivedSequence:
    """One sequence's chain of frames, checked: contiguous from token 0, of this model, every
    frame with its chunk's token ids."""

    archive: str  # where it was read from (`BoundaryArchive.describe`)
    sequence_id: str
    frames: tuple[BoundaryFrame, ...]

    @property
    def token_ids(self) -> list[int]:
        """Every archived token, in order (the chunks' ids joined)."""
        return [t for frame in self.frames for t in frame.token_ids or ()]

    @property
    def tokens(self) -> int:
        return self.frames[-1].token_end


def archived_sequence(archive: BoundaryArchive, sequence_id: str, model: Model) -> ArchivedSequence:
    """The chain of `sequence_id` in `archive`, checked against `model`; a typed error naming
    what is wrong (and, for an unknown sequence, the sequences there are)."""
    where = archive.describe()
    frames = archive.frames()  # BoundaryArchiveError / BoundaryFormatError name the file
    chain = tuple(f for f in frames if f.sequence_id == sequence_id)
    if not chain:
        held = sorted({f.sequence_id for f in frames})
        if not held:
            raise UnknownSequence(f"the boundary archive {where} holds no frames")
        names = ", ".join(shown(name) for name in held[:NAMES_SHOWN])
        more = f" and {len(held) - NAMES_SHOWN} more" if len(held) > NAMES_SHOWN else ""
        raise UnknownSequence(
            f"the boundary archive {where} holds no sequence {sequence_id!r}; it holds "
            f"{names}{more} (larql boundary ls {where})"
        )
    _check_chain(chain, sequence_id)
    _check_model(chain, sequence_id, model)
    return ArchivedSequence(where, sequence_id, chain)


def _check_chain(chain: tuple[BoundaryFrame, ...], sequence_id: str) -> None:
    old = next((f for f in chain if f.token_ids is None), None)
    if old is not None:
        raise NotResumable(
            f"frame {shown(old.boundary_id)} is version {old.version}, written before frames "
            f"carried their token ids; only frames of version {TOKEN_IDS_SINCE} or later can be "
            "resumed"
        )
    runs = sorted({f.run_id for f in chain})
    if len(runs) > 1:
        raise NotResumable(
            f"sequence {sequence_id!r} holds frames of {len(runs)} runs "
            f"({', '.join(shown(run) for run in runs[:2])}); "
            "a resumable sequence is one run's"
        )
    expected = 0
    for frame in chain:
        if frame.token_start != expected:
            raise NotResumable(
                f"sequence {sequence_id!r} has no frame for tokens {expected}–{frame.token_start} "
                f"(its frames must cover every token from 0)"
            )
        expected = frame.token_end


def _check_model(chain: tuple[BoundaryFrame, ...], sequence_id: str, model: Model) -> None:
    ours = model_identity(model)
    cfg = model.config
    for frame in chain:
        theirs = frame.identity
        for field in ("model_id", "model_revision", "tokenizer_revision", "architecture"):
            if getattr(theirs, field) != getattr(ours, field):
                raise ArchiveMismatch(
                    f"sequence {sequence_id!r} was written by model {shown(theirs.model_id)} "
                    f"({field} {shown(getattr(theirs, field))}); this is {ours.model_id} "
                    f"({field} {getattr(ours, field)})"
                )
        if frame.hidden_size != cfg.hidden_size or frame.layer != cfg.num_layers - 1:
            raise ArchiveMismatch(
                f"frame {shown(frame.boundary_id)} holds layer {frame.layer} of width "
                f"{frame.hidden_size}; {model.name} has {cfg.num_layers} layers of width "
                f"{cfg.hidden_size}"
            )
        bad = next((t for t in frame.token_ids or () if t >= cfg.vocab_size), None)
        if bad is not None:
            raise NotResumable(
                f"frame {shown(frame.boundary_id)} holds token id {bad}, outside {model.name}'s "
                f"vocabulary (0..{cfg.vocab_size - 1})"
            )
    if chain[-1].token_end > cfg.max_positions:
        raise NotResumable(
            f"sequence {sequence_id!r} holds {chain[-1].token_end} tokens; {model.name} holds "
            f"{cfg.max_positions}"
        )


def residual_distance(frame: BoundaryFrame, row: torch.Tensor) -> float | None:
    """Relative L2 distance between the frame's stored residual and the rebuilt row [H] at its
    position, the row clipped as the codec clipped the stored one; None: no payload."""
    if frame.payload.codec == "none":
        return None
    stored = frame.residual().double()  # [H]
    rebuilt = row.detach().reshape(-1).to(device="cpu", dtype=torch.float64)  # [H]
    if frame.payload.codec == "int8_clip3sigma":
        scale = float(codecs.int8_scale(rebuilt.float().numpy()))
        rebuilt = rebuilt.clamp(-codecs.INT8_LEVELS * scale, codecs.INT8_LEVELS * scale)
    norm = float(rebuilt.norm())
    gap = float((stored - rebuilt).norm())
    return gap / norm if norm > 0 else gap


def check_residuals(sequence: ArchivedSequence, rows: torch.Tensor) -> float:
    """Compare the stored residuals with the rebuilt context's rows: `rows` [S, H] for every
    archived position, or fewer (an engine that returns only its last rows) — then the frames
    whose positions are among the last ones. → the largest relative distance (0.0 where no frame
    had a payload); `ArchiveMismatch` where one is past its codec's tolerance."""
    first = sequence.tokens - rows.shape[0]  # the position of rows[0]
    worst = 0.0
    for frame in sequence.frames:
        index = frame.token_end - 1 - first
        if index < 0:
            continue
        distance = residual_distance(frame, rows[index])
        if distance is None:
            continue
        worst = max(worst, distance)
        tolerance = RESIDUAL_TOLERANCE[frame.payload.codec]
        if not distance <= tolerance:  # (a NaN row fails too)
            raise ArchiveMismatch(
                f"the rebuilt context does not reproduce frame {shown(frame.boundary_id)}: its "
                f"residual "
                f"is {distance:.3g} away (relative L2; {frame.payload.codec} allows "
                f"{tolerance}) — the archive was written with another dtype, window or engine, "
                "or its token ids were changed"
            )
    return worst
