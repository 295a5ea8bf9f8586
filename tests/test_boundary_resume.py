"""Resuming a sequence a `boundary-kv:archive=DIR` run archived: the rebuilt context continues as
the uninterrupted run does, the stored residuals check the rebuild, every broken or mismatched
archive is a typed one-line error, and `larql run --resume` end to end."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from typer.testing import CliRunner

import larql
from helpers import first_layers
from larql.api.generation import prompt_ids
from larql.cli.app import app
from larql.errors import InvalidInput, LarqlError
from larql.inference.ffn import DenseFfn
from larql.kv.boundary import (
    BoundaryArchiveError,
    BoundaryFormatError,
    BoundaryKvEngine,
    DirectoryBoundaryArchive,
)
from larql.kv.boundary.archive import METADATA_KEY, frame_file_name
from larql.kv.boundary.frames import BoundaryFrame, BoundaryModelIdentity
from larql.kv.boundary.gate import GateConfig
from larql.kv.boundary.resume import (
    ArchiveMismatch,
    NotResumable,
    UnknownSequence,
    residual_distance,
)
from larql.kv.resolve import ENV_VAR
from larql.kv.standard import StandardEngine
from larql.models import Model

TEXT = "Alice put the red ball in the box, and Bob took it out again and ran away"
CHUNK = 8
NEW_TOKENS = 12  # the run feeds prompt + 11 ids: frames at 8, 16, 24 (24 reached decoding)
QUESTION = " Where is the ball now?"


@dataclasses.dataclass(frozen=True)
class Written:
    archive: Path
    spec: str
    sequence: str
    ids: list[int]  # every id the run fed its engine, in order


@pytest.fixture(scope="module")
def model(smollm2: Model) -> Model:
    """The real model's first two layers: frames, chains and residual checks work on any
    depth, and every run here is compared with the same model's own."""
    return first_layers(smollm2, 2)


@pytest.fixture(scope="module")
def written(model: Model, tmp_path_factory: pytest.TempPathFactory) -> Written:
    archive = tmp_path_factory.mktemp("archive")
    spec = f"boundary-kv:chunk_tokens={CHUNK},archive={archive}"
    run = larql.generate(model, spec, TEXT, max_new_tokens=NEW_TOKENS)
    fed = len(run.prompt_ids) + NEW_TOKENS - 1  # the last id is picked, never fed
    assert 2 * CHUNK <= len(run.prompt_ids) < 3 * CHUNK <= fed < 4 * CHUNK
    (sequence,) = DirectoryBoundaryArchive(archive).sequences()
    return Written(archive, spec, sequence, run.prompt_ids + run.token_ids[:-1])


def archived_ids(written: Written) -> list[int]:
    return written.ids[: 3 * CHUNK]


def copy_of(written: Written, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(written.archive, target)
    return target


def chain(archive: Path, sequence: str) -> list[BoundaryFrame]:
    return DirectoryBoundaryArchive(archive).load_chain(sequence)


def rewrite(archive: Path, frame: BoundaryFrame) -> None:
    DirectoryBoundaryArchive(archive).append(frame)  # replaces the file of its sequence and end


def one_line(error: pytest.ExceptionInfo[LarqlError]) -> str:
    message = str(error.value)
    assert message and "\n" not in message
    return message


# ---------------------------------------------------------------------------- what a rebuild is


def test_the_chain_holds_every_token_fed_up_to_its_last_frame(written: Written) -> None:
    frames = chain(written.archive, written.sequence)
    assert [f.token_end for f in frames] == [CHUNK, 2 * CHUNK, 3 * CHUNK]
    assert [t for f in frames for t in f.token_ids] == archived_ids(written)


@pytest.mark.slow
def test_resume_continues_exactly_as_the_uninterrupted_run(written: Written, model: Model) -> None:
    resumed = larql.generate(
        model, written.spec, QUESTION, max_new_tokens=10, resume=written.sequence
    )
    whole = archived_ids(written) + prompt_ids(model, QUESTION)
    reference = larql.generate(model, "standard", whole, max_new_tokens=10)
    assert resumed.token_ids == reference.token_ids
    info = resumed.resumed
    assert info is not None and info.sequence_id == written.sequence
    assert (info.tokens, info.frames) == (3 * CHUNK, 3)
    assert info.residual_distance is not None and info.residual_distance < 0.005  # bf16 rounding
    # the continuing run archives a new sequence that re-derives the resumed one first
    assert info.continued_as not in (None, written.sequence)
    onward = chain(written.archive, info.continued_as)
    assert [t for f in onward for t in f.token_ids][: 3 * CHUNK] == archived_ids(written)
    again = larql.resume(model, "standard", info.continued_as, archive=written.archive)
    assert list(again.token_ids[: len(whole)]) == whole


@pytest.mark.slow
def test_resume_gives_a_state_with_the_uninterrupted_runs_logits(
    written: Written, model: Model
) -> None:
    state = larql.resume(model, "standard", written.sequence, archive=written.archive)
    assert list(state.token_ids) == archived_ids(written) and state.position == 3 * CHUNK
    fresh = larql.prefill(model, "standard", archived_ids(written))
    torch.testing.assert_close(state.logits(), fresh.logits(), rtol=0, atol=1e-4)
    continued = larql.generate(model, state, QUESTION, max_new_tokens=6)
    from_fresh = larql.generate(model, fresh, QUESTION, max_new_tokens=6)
    assert continued.token_ids == from_fresh.token_ids
    assert state.position == 3 * CHUNK  # generate continued a fork


def test_the_residual_check_refuses_a_rebuild_that_computes_otherwise(
    written: Written, model: Model
) -> None:
    windowed = "standard:window=4"
    with pytest.raises(ArchiveMismatch, match="does not reproduce frame") as error:
        larql.resume(model, windowed, written.sequence, archive=written.archive)
    assert "window" in one_line(error)
    state = larql.resume(model, windowed, written.sequence, archive=written.archive, verify=False)
    assert state.position == 3 * CHUNK


def test_int8_payloads_are_checked_within_their_codec(model: Model, tmp_path: Path) -> None:
    engine = BoundaryKvEngine(
        chunk_tokens=2,
        sequence_id="gated",
        archive=DirectoryBoundaryArchive(tmp_path),
        gate=GateConfig(calibration_mode=False),
    )
    ids = model.tokenizer.encode(TEXT)[:16]
    with torch.inference_mode():
        engine.prefill(model, DenseFfn(model), ids)
    codecs_written = {f.payload.codec for f in chain(tmp_path, "gated")}
    assert "int8_clip3sigma" in codecs_written  # the gate compressed the confident ones
    state = larql.resume(model, "standard", "gated", archive=tmp_path)
    assert list(state.token_ids) == ids
    with torch.inference_mode():
        rows = StandardEngine().prefill_all(model, DenseFfn(model), ids)  # [16, H]
    for frame in chain(tmp_path, "gated"):
        if frame.payload.codec == "int8_clip3sigma":  # its own row within tolerance, no other
            assert residual_distance(frame, rows[frame.token_end - 1]) < 0.05
            assert residual_distance(frame, rows[frame.token_end - 2]) > 0.05


# ---------------------------------------------------------------------------- bad archives


def test_an_unknown_sequence_names_those_there_are(written: Written, model: Model) -> None:
    with pytest.raises(UnknownSequence) as error:
        larql.resume(model, written.spec, "nope")
    message = one_line(error)
    assert "'nope'" in message and written.sequence in message


def test_names_from_a_file_are_shown_on_one_line(
    written: Written, model: Model, tmp_path: Path
) -> None:
    archive = copy_of(written, tmp_path)
    first = chain(archive, written.sequence)[0]
    rewrite(archive, dataclasses.replace(first, sequence_id="evil\n[/bold]"))
    with pytest.raises(UnknownSequence) as error:
        larql.resume(model, "standard", "nope", archive=archive)
    assert "'evil\\n(/bold)'" in one_line(error)


def test_a_refused_rebuild_leaves_no_frames_behind(
    written: Written, model: Model, tmp_path: Path
) -> None:
    archive = copy_of(written, tmp_path)
    before = DirectoryBoundaryArchive(archive).sequences()
    windowed = f"boundary-kv:chunk_tokens={CHUNK},window=4,archive={archive}"
    with pytest.raises(ArchiveMismatch):
        larql.generate(model, windowed, "x", max_new_tokens=1, resume=written.sequence)
    assert DirectoryBoundaryArchive(archive).sequences() == before


def test_a_missing_or_empty_archive(model: Model, tmp_path: Path) -> None:
    with pytest.raises(BoundaryArchiveError, match="no boundary archive") as error:
        larql.resume(model, "standard", "s", archive=tmp_path / "nowhere")
    one_line(error)
    with pytest.raises(UnknownSequence, match="holds no frames"):
        larql.resume(model, "standard", "s", archive=tmp_path)
    with pytest.raises(InvalidInput, match="boundary-kv:archive=DIR"):
        larql.resume(model, "standard", "s")


def test_a_corrupt_frame_file_is_named(written: Written, model: Model, tmp_path: Path) -> None:
    archive = copy_of(written, tmp_path)
    target = archive / frame_file_name(written.sequence, CHUNK)
    target.write_bytes(target.read_bytes()[:100])
    with pytest.raises(BoundaryFormatError) as error:
        larql.resume(model, "standard", written.sequence, archive=archive)
    assert target.name in one_line(error)


def test_frames_of_another_model_are_refused(
    written: Written, model: Model, tmp_path: Path
) -> None:
    archive = copy_of(written, tmp_path)
    last = chain(archive, written.sequence)[-1]
    other = BoundaryModelIdentity("smollm2-135m", "other.gguf@0123", "sha256:x", "llama")
    rewrite(archive, dataclasses.replace(last, identity=other))
    with pytest.raises(ArchiveMismatch, match=r"model_revision other\.gguf@0123\)") as error:
        larql.resume(model, "standard", written.sequence, archive=archive)
    one_line(error)


def test_a_gap_in_the_chain_is_refused(written: Written, model: Model, tmp_path: Path) -> None:
    archive = copy_of(written, tmp_path)
    (archive / frame_file_name(written.sequence, 2 * CHUNK)).unlink()
    with pytest.raises(NotResumable, match=f"no frame for tokens {CHUNK}–{2 * CHUNK}") as error:
        larql.resume(model, "standard", written.sequence, archive=archive)
    one_line(error)


def test_frames_without_token_ids_are_refused(
    written: Written, model: Model, tmp_path: Path
) -> None:
    archive = copy_of(written, tmp_path)
    first = chain(archive, written.sequence)[0]
    doc = first.to_json()
    doc["version"] = 2
    del doc["token_ids"]
    payload = torch.frombuffer(bytearray(first.payload.data), dtype=torch.uint8)
    path = archive / frame_file_name(written.sequence, CHUNK)
    save_file({"payload": payload}, str(path), metadata={METADATA_KEY: json.dumps(doc)})
    with pytest.raises(NotResumable, match="version 2") as error:
        larql.resume(model, "standard", written.sequence, archive=archive)
    one_line(error)


@pytest.mark.parametrize("token_ids", [[1, 2], "12345678", [1.5] * CHUNK, [-1] * CHUNK])
def test_malformed_token_ids_are_format_errors(
    written: Written, tmp_path: Path, token_ids: object
) -> None:
    first = chain(written.archive, written.sequence)[0]
    doc = first.to_json() | {"token_ids": token_ids}
    with pytest.raises(BoundaryFormatError, match="'token_ids' must list the chunk's 8"):
        BoundaryFrame.from_json(doc, first.payload.data)


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 2**40), max_size=24), cut=st.booleans())
def test_token_ids_survive_the_file_format_and_their_count_is_checked(
    written: Written, ids: list[int], cut: bool
) -> None:
    first = chain(written.archive, written.sequence)[0]
    frame = dataclasses.replace(first, token_start=3, token_end=3 + len(ids), token_ids=tuple(ids))
    doc = json.loads(json.dumps(frame.to_json()))  # as the directory archive stores it
    assert BoundaryFrame.from_json(doc, frame.payload.data) == frame
    doc["token_ids"] = ids[:-1] if cut else [*ids, 0]
    if cut and not ids:
        doc["token_ids"] = None
    with pytest.raises(BoundaryFormatError, match=f"chunk's {len(ids)} token ids"):
        BoundaryFrame.from_json(doc, frame.payload.data)


def test_ids_outside_the_vocabulary_and_changed_ids(
    written: Written, model: Model, tmp_path: Path
) -> None:
    archive = copy_of(written, tmp_path)
    last = chain(archive, written.sequence)[-1]
    ids = list(last.token_ids)
    rewrite(archive, dataclasses.replace(last, token_ids=(*ids[:-1], 10**7)))
    with pytest.raises(NotResumable, match="outside smollm2-135m's vocabulary") as error:
        larql.resume(model, "standard", written.sequence, archive=archive)
    one_line(error)
    changed = (ids[-1] + 1) % model.config.vocab_size
    rewrite(archive, dataclasses.replace(last, token_ids=(*ids[:-1], changed)))
    with pytest.raises(ArchiveMismatch, match=f"frame {written.sequence}:{3 * CHUNK}"):
        larql.resume(model, "standard", written.sequence, archive=archive)


def test_a_sequence_of_two_runs_is_refused(written: Written, model: Model, tmp_path: Path) -> None:
    archive = copy_of(written, tmp_path)
    last = chain(archive, written.sequence)[-1]
    rewrite(archive, dataclasses.replace(last, run_id="0123456789abcdef"))
    with pytest.raises(NotResumable, match="2 runs"):
        larql.resume(model, "standard", written.sequence, archive=archive)


def test_resume_is_refused_beside_a_state(written: Written, model: Model) -> None:
    state = larql.prefill(model, "standard", "Hello")
    with pytest.raises(InvalidInput, match="not both"):
        larql.generate(model, state, "x", resume=written.sequence)


# ---------------------------------------------------------------------------- the CLI


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


@pytest.mark.slow
def test_larql_run_resume_end_to_end(cli, smollm2_default: Model, tmp_path: Path) -> None:
    archive = tmp_path / "frames"
    spec = f"boundary-kv:chunk_tokens={CHUNK},archive={archive}"
    first = cli("run", TEXT, "-n", str(NEW_TOKENS), "--engine", spec)
    assert first.exit_code == 0, first.output
    (sequence,) = DirectoryBoundaryArchive(archive).sequences()
    ids = [t for f in chain(archive, sequence) for t in f.token_ids]

    resumed = cli("run", QUESTION, "-n", "8", "--engine", spec, "--resume", sequence)
    assert resumed.exit_code == 0, resumed.output
    assert f"resumed sequence {sequence}" in resumed.stderr
    assert f"({len(ids)} tokens, 3 frames" in resumed.stderr
    whole = ids + prompt_ids(smollm2_default, QUESTION)
    reference = larql.generate(smollm2_default, "standard", whole, max_new_tokens=8)
    assert resumed.stdout == reference.text + "\n"

    unknown = cli("run", "x", "-n", "2", "--engine", spec, "--resume", "nope")
    assert unknown.exit_code == 2 and unknown.stderr.count("\n") == 1
    assert "no sequence 'nope'" in unknown.stderr and sequence in unknown.stderr
    nowhere = cli("run", "x", "-n", "2", "--engine", "standard", "--resume", sequence)
    assert nowhere.exit_code == 2 and "boundary-kv:archive=DIR" in nowhere.stderr
    both = cli("run", "x", "--resume", sequence, "--load-state", str(tmp_path))
    assert both.exit_code == 2 and "not both" in both.stderr
