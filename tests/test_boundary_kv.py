"""`boundary-kv`: standard decoding plus a boundary frame at every multiple of chunk_tokens —
in the prompt and while decoding — with the frame contents, an in-memory and a
directory archive, the residual codecs, and `larql boundary ls`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from larql.cli.app import app
from larql.inference.errors import BackendFailure, InvariantViolation
from larql.inference.ffn import DenseFfn
from larql.inference.layer import final_logits
from larql.kv import parse_engine
from larql.kv.boundary import (
    BoundaryArchive,
    BoundaryFormatError,
    BoundaryFrame,
    BoundaryKvEngine,
    DirectoryBoundaryArchive,
    InMemoryBoundaryArchive,
    codecs,
)
from larql.kv.boundary.archive import frame_file_name
from larql.kv.boundary.frames import Agreement, PayloadContract
from larql.kv.boundary.gate import GateConfig, GateDecision, payload_plan
from larql.kv.resolve import ENV_VAR
from larql.kv.spec import EngineBuildError, MalformedEngineSpec
from larql.kv.standard import StandardEngine
from larql.models import Model

TEXT = "Alice put the red ball in the box, and Bob took it out again and ran away"
CHUNK = 4
PROMPT_LEN = 10  # crosses the boundaries at 4 and 8 inside the prompt
TOTAL = 18  # decoding then reaches 12 and 16


@dataclass
class Run:
    engine: BoundaryKvEngine
    ids: list[int]
    hidden: list[torch.Tensor]  # engine outputs: prefill, then each decode step
    standard_hidden: list[torch.Tensor]
    rows: torch.Tensor  # [TOTAL, H] the standard hidden of every position


def drive(engine, model: Model, ids: list[int], prompt_len: int) -> list[torch.Tensor]:
    ffn = DenseFfn(model)
    with torch.inference_mode():
        out = [engine.prefill(model, ffn, ids[:prompt_len])]
        out += [engine.decode_step(model, ffn, t) for t in ids[prompt_len:]]
    return out


@pytest.fixture(scope="module")
def run(smollm2: Model) -> Run:
    ids = smollm2.tokenizer.encode(TEXT)[:TOTAL]
    assert len(ids) == TOTAL
    engine = BoundaryKvEngine(chunk_tokens=CHUNK, sequence_id="story")
    hidden = drive(engine, smollm2, ids, PROMPT_LEN)
    standard = StandardEngine()
    standard_hidden = drive(standard, smollm2, ids, PROMPT_LEN)
    with torch.inference_mode():
        prompt_rows = StandardEngine().prefill_all(smollm2, DenseFfn(smollm2), ids[:PROMPT_LEN])
    rows = torch.cat([prompt_rows, *standard_hidden[1:]])
    return Run(engine, ids, hidden, standard_hidden, rows)


# ---------------------------------------------------------------------------- spec


def test_spec_defaults_and_validation() -> None:
    kind = parse_engine("boundary")
    assert kind.display_name == "boundary-kv"
    assert dict(kind.params) == {
        "chunk_tokens": 512,
        "sequence_id": None,
        "window": None,
        "archive": None,
    }
    kind = parse_engine("boundary-kv:chunk_tokens=64,sequence_id=demo,window=128")
    assert (kind.params["chunk_tokens"], kind.params["sequence_id"]) == (64, "demo")
    assert parse_engine(kind.spec()) == kind
    for bad in ("boundary-kv:chunk_tokens=0", "boundary:window=0", "boundary:codec=int8"):
        with pytest.raises(MalformedEngineSpec):
            parse_engine(bad)
    with pytest.raises(EngineBuildError):
        BoundaryKvEngine(chunk_tokens=0)


# ---------------------------------------------------------------------------- contract


def test_output_is_bit_identical_to_standard(run: Run) -> None:
    for ours, reference in zip(run.hidden, run.standard_hidden, strict=True):
        assert torch.equal(ours, reference)


def test_frames_at_every_multiple_of_chunk_tokens(run: Run) -> None:
    frames = run.engine.frames()
    assert [f.token_end for f in frames] == [4, 8, 12, 16]
    assert [f.token_start for f in frames] == [0, 4, 8, 12]  # the chain is contiguous
    assert [f.boundary_id for f in frames] == ["story:4", "story:8", "story:12", "story:16"]
    assert run.engine.frames_emitted == 4 == run.engine.archive.total_frames()


def test_each_frame_carries_the_hidden_of_its_last_position(run: Run, smollm2: Model) -> None:
    for frame in run.engine.frames():
        row = run.rows[frame.token_end - 1]  # [H]
        # bf16 keeps 8 significant bits: the relative error per element is at most 2^-8.
        assert torch.allclose(frame.residual(), row, rtol=2**-8, atol=1e-30)
        logits = final_logits(smollm2, row[None])[0].double()
        top2 = torch.topk(logits, 2)
        meta = frame.metadata
        assert (meta.top1_token_id, meta.top2_token_id) == tuple(top2.indices.tolist())
        assert meta.top1_logit == pytest.approx(top2.values[0].item(), abs=1e-4)
        assert meta.raw_logit_margin == pytest.approx(meta.top1_logit - meta.top2_logit, abs=1e-4)
        probs = torch.softmax(logits, -1)
        assert meta.raw_top1_prob == pytest.approx(probs[meta.top1_token_id].item(), rel=1e-6)
        expected_margin = math.log(probs[meta.top1_token_id] / probs[meta.top2_token_id])
        assert meta.raw_log_prob_margin == pytest.approx(expected_margin, rel=1e-6)
        assert meta.top1_text == smollm2.tokenizer.decode([meta.top1_token_id])


def test_agreement_is_the_int8_round_trip_top1_check(run: Run, smollm2: Model) -> None:
    for frame in run.engine.frames():
        row = run.rows[frame.token_end - 1]
        restored = codecs.round_trip("int8_clip3sigma", row)[None]
        agrees = int(final_logits(smollm2, restored)[0].argmax()) == frame.metadata.top1_token_id
        assert frame.metadata.agreement is (Agreement.AGREES if agrees else Agreement.DISAGREES)
        assert frame.metadata.codec_fragile is (not agrees)


def test_calibration_mode_stores_bf16_and_flags_fragile_boundaries(run: Run) -> None:
    for frame in run.engine.frames():
        assert frame.payload.codec == "bf16"
        assert frame.payload.contract is PayloadContract.CALIBRATING
        assert frame.payload.nbytes == 2 * frame.hidden_size
        meta = frame.metadata
        fragile = meta.raw_log_prob_margin < 1.0 or meta.raw_top1_prob < 0.5
        assert meta.boundary_fragile is fragile


def test_identity_and_layout(run: Run, smollm2: Model) -> None:
    for frame in run.engine.frames():
        assert frame.version == 3 and frame.run_id == run.engine.run_id
        assert frame.token_ids == tuple(run.ids[frame.token_start : frame.token_end])
        assert frame.identity.model_id == smollm2.name
        assert frame.identity.architecture == smollm2.config.arch.name
        assert frame.identity.model_revision.startswith(smollm2.source.name + "@")
        assert frame.identity.tokenizer_revision.startswith("sha256:")
        assert frame.layer == smollm2.config.num_layers - 1
        assert frame.hidden_size == smollm2.config.hidden_size
        assert frame.sequence_id == "story"


def test_memory_is_the_inner_standard_engines(run: Run, smollm2: Model) -> None:
    assert run.engine.memory() == run.engine.inner.memory()
    assert run.engine.memory().hot > 0 and run.engine.window_tokens() == TOTAL
    info = run.engine.info()
    assert info.config == "chunk_tokens=4,sequence_id=story,window=full"
    assert "archived=4 frames" in info.description
    assert f"{4 * 2 * smollm2.config.hidden_size} payload bytes" in info.description


def test_no_frame_until_a_boundary_is_reached(smollm2: Model) -> None:
    engine = BoundaryKvEngine(chunk_tokens=CHUNK)
    ids = smollm2.tokenizer.encode(TEXT)[:5]
    drive(engine, smollm2, ids, 3)  # positions 0..4: the boundary at 4 is reached by decode
    assert [f.token_end for f in engine.frames()] == [4]
    with pytest.raises(InvariantViolation):
        BoundaryKvEngine().decode_step(smollm2, DenseFfn(smollm2), 1)


def test_prompt_of_an_exact_multiple_and_chunk_of_one(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(TEXT)[:8]
    engine = BoundaryKvEngine(chunk_tokens=4)
    drive(engine, smollm2, ids, 8)
    assert [f.token_end for f in engine.frames()] == [4, 8]
    every = BoundaryKvEngine(chunk_tokens=1)
    drive(every, smollm2, ids, 6)
    assert [f.token_end for f in every.frames()] == list(range(1, 9))
    assert [f.token_start for f in every.frames()] == list(range(8))


def test_windowed_inner_engine_matches_standard_window(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(TEXT)[:9]
    ours = drive(
        parse_engine("boundary-kv:chunk_tokens=3,window=4").build(smollm2), smollm2, ids, 6
    )
    reference = drive(parse_engine("standard:window=4").build(smollm2), smollm2, ids, 6)
    for a, b in zip(ours, reference, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------- gate


def test_gate_decisions() -> None:
    calibrating = GateConfig()
    for agreement in Agreement:
        assert calibrating.decide(agreement, False) is GateDecision.USE_BF16
    live = GateConfig(calibration_mode=False)
    assert live.decide(Agreement.AGREES, False) is GateDecision.COMPRESSED_OK
    assert live.decide(Agreement.AGREES, True) is GateDecision.USE_BF16
    assert live.decide(Agreement.NOT_CHECKED, False) is GateDecision.USE_BF16
    assert live.decide(Agreement.DISAGREES, False) is GateDecision.COLD_REPLAY
    assert payload_plan(GateDecision.COMPRESSED_OK) == (
        "int8_clip3sigma",
        PayloadContract.TOP1_PRESERVED,
    )
    assert payload_plan(GateDecision.REJECT) == ("none", PayloadContract.UNKNOWN)
    assert calibrating.boundary_fragile(0.99, 0.9) and calibrating.boundary_fragile(2.0, 0.49)
    assert not calibrating.boundary_fragile(1.0, 0.5)


def test_live_gate_payloads_follow_the_decision(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(TEXT)[:16]
    engine = BoundaryKvEngine(chunk_tokens=2, gate=GateConfig(calibration_mode=False))
    drive(engine, smollm2, ids, 16)
    frames = engine.frames()
    assert len(frames) == 8
    for frame in frames:
        meta = frame.metadata
        decision = engine.gate.decide(meta.agreement, meta.boundary_fragile)
        codec, contract = payload_plan(decision)
        assert (frame.payload.codec, frame.payload.contract) == (codec, contract)
        if codec == "int8_clip3sigma":
            assert frame.payload.nbytes == 4 + frame.hidden_size
        if codec == "none":
            assert frame.payload.nbytes == 0
            with pytest.raises(BoundaryFormatError):
                frame.residual()


def test_agreement_can_be_switched_off(smollm2: Model) -> None:
    engine = BoundaryKvEngine(chunk_tokens=2, verify_agreement=False)
    drive(engine, smollm2, smollm2.tokenizer.encode(TEXT)[:4], 4)
    for frame in engine.frames():
        assert frame.metadata.agreement is Agreement.NOT_CHECKED
        assert frame.metadata.codec_fragile is False


# ---------------------------------------------------------------------------- archives


@pytest.mark.slow
def test_directory_archive_round_trips_in_a_fresh_load(run: Run, tmp_path: Path) -> None:
    archive = DirectoryBoundaryArchive(tmp_path / "frames")
    for frame in run.engine.frames():
        archive.append(frame)
    files = sorted(p.name for p in (tmp_path / "frames").iterdir())
    assert files == [frame_file_name("story", e) for e in (4, 8, 12, 16)]
    reloaded = DirectoryBoundaryArchive(tmp_path / "frames")
    assert reloaded.frames() == run.engine.frames()  # every field, payload bytes included
    assert reloaded.load_chain("story") == run.engine.frames()
    assert reloaded.sequences() == ["story"]
    # A later process reads the same frames.
    script = (
        "import json, sys; from larql.kv.boundary import DirectoryBoundaryArchive as A; "
        "fs = A(sys.argv[1]).frames(); "
        "print(json.dumps([[f.boundary_id, f.residual().sum().item()] for f in fs]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "frames")],
        capture_output=True,
        text=True,
        check=True,
    )
    expected = [[f.boundary_id, f.residual().sum().item()] for f in run.engine.frames()]
    assert json.loads(out.stdout) == expected


def test_rewriting_a_boundary_replaces_it(run: Run, tmp_path: Path) -> None:
    frame = run.engine.frames()[0]
    for archive in (InMemoryBoundaryArchive(), DirectoryBoundaryArchive(tmp_path)):
        archive.append(frame)
        archive.append(frame)
        assert archive.total_frames() == 1


def test_odd_sequence_ids_get_distinct_safe_file_names() -> None:
    names = {frame_file_name(s, 4) for s in ("a/b", "a:b", "a_b", "", "ü")}
    assert len(names) == 5
    assert all("/" not in n and ":" not in n and n.isascii() for n in names)


def test_archive_write_failure_is_a_backend_failure(smollm2: Model, tmp_path: Path) -> None:
    in_the_way = tmp_path / "not-a-directory"
    in_the_way.write_text("a file where the archive directory should be")
    with pytest.raises(EngineBuildError, match="not a directory"):  # refused before decoding
        parse_engine(f"boundary-kv:chunk_tokens=2,archive={in_the_way}").build(smollm2)
    in_the_way.unlink()
    engine = parse_engine(f"boundary-kv:chunk_tokens=2,archive={in_the_way}").build(smollm2)
    in_the_way.write_text("a file that appeared after the engine was built")
    ids = smollm2.tokenizer.encode(TEXT)[:3]
    with pytest.raises(BackendFailure, match="boundary frame emit failed"):
        engine.prefill(smollm2, DenseFfn(smollm2), ids)

    class Broken(BoundaryArchive):
        def append(self, frame: BoundaryFrame) -> None:
            raise RuntimeError("disk on fire")

        def frames(self) -> list[BoundaryFrame]:
            return []

        def describe(self) -> str:
            return "broken"

    engine = BoundaryKvEngine(chunk_tokens=2, archive=Broken())
    with pytest.raises(BackendFailure, match="disk on fire"):
        engine.prefill(smollm2, DenseFfn(smollm2), ids)


def test_unreadable_frames_are_typed_errors(tmp_path: Path) -> None:
    (tmp_path / frame_file_name("x", 4)).write_bytes(b"not safetensors")
    with pytest.raises(BoundaryFormatError):
        DirectoryBoundaryArchive(tmp_path).frames()


# ---------------------------------------------------------------------------- codecs


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(2, 600),  # a one-element row is constant (see the next test)
    seed=st.integers(0, 2**31 - 1),
    outlier=st.floats(0.0, 50.0),
)
def test_int8_round_trip_error_bound(size: int, seed: int, outlier: float) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, generator=g)
    x[0] += outlier  # a residual-style outlier gets clipped
    payload = codecs.int8_encode(x)
    assert len(payload) == 4 + size
    scale = float(torch.frombuffer(bytearray(payload[:4]), dtype=torch.float32)[0])
    sigma = x.double().std(unbiased=False).item()
    assert scale == pytest.approx(3 * sigma / 127, rel=1e-6)
    y = codecs.int8_decode(payload, size)
    inside = x.abs() <= 127 * scale
    slack = 1e-5 * max(scale, 1e-30)
    assert ((x - y).abs()[inside] <= scale / 2 + slack).all()
    assert torch.allclose(y[~inside].abs(), torch.tensor(127 * scale), rtol=1e-6)
    assert (torch.sign(y[~inside]) == torch.sign(x[~inside])).all()


def test_int8_constant_and_zero_rows_are_safe() -> None:
    for row in (torch.zeros(8), torch.full((8,), 3.0)):
        out = codecs.round_trip("int8_clip3sigma", row)
        assert torch.isfinite(out).all() and out.shape == (8,)


def test_bf16_is_round_to_nearest_even() -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 10
    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8)])  # exact halfway cases
    row = torch.cat([x, ties])
    ours = codecs.round_trip("bf16", row)
    assert torch.equal(ours, row.to(torch.bfloat16).float())  # torch rounds to nearest even
    assert ours[-3:].tolist() == [1.0, 1.0 + 2**-6, -1.0]
    assert ((ours - row).abs() <= row.abs() * 2**-8).all()  # half a unit in the 8th bit
    with pytest.raises(codecs.CodecError):
        codecs.decode("bf16", b"\x00" * 3, 2)
    with pytest.raises(codecs.CodecError):
        codecs.encode("int4", row)


# ---------------------------------------------------------------------------- CLI


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


def test_boundary_ls_lists_an_archive_written_by_larql_run(
    cli, smollm2: Model, tmp_path: Path
) -> None:
    archive = tmp_path / "frames"
    prompt = "The capital of France is"
    result = cli(
        "run",
        prompt,
        "-n",
        "12",
        "--engine",
        f"boundary-kv:chunk_tokens=4,archive={archive}",
        "--output",
        "json",
    )
    assert result.exit_code == 0, result.output
    generated = json.loads(result.stdout.strip().splitlines()[-1])
    positions = generated["prompt_tokens"] + len(generated["tokens"]) - 1  # last token not fed
    expected_ends = list(range(4, positions + 1, 4))

    listed = cli("boundary", "ls", str(archive), "--output", "json")
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.stdout)
    assert [r["token_end"] for r in rows] == expected_ends
    (sequence,) = {r["sequence_id"] for r in rows}  # a fresh id for the run
    assert sequence.startswith("seq-") and len({r["run_id"] for r in rows}) == 1
    assert all(r["payload_codec"] == "bf16" and r["payload_bytes"] == 2 * 576 for r in rows)
    assert all(r["model_id"] == smollm2.name for r in rows)

    table = cli("boundary", "ls", str(archive))
    assert table.exit_code == 0, table.output
    assert sequence in table.stdout and "bf16" in table.stdout


def test_two_runs_into_one_archive_never_share_a_sequence(cli, tmp_path: Path) -> None:
    archive = tmp_path / "frames"
    for prompt, n in (("Once upon a time", "10"), ("The capital of France is", "6")):
        spec = f"boundary-kv:chunk_tokens=4,archive={archive}"
        assert cli("run", prompt, "-n", n, "--engine", spec).exit_code == 0
    rows = json.loads(cli("boundary", "ls", str(archive), "--output", "json").stdout)
    by_sequence: dict[str, set[str]] = {}
    for r in rows:
        by_sequence.setdefault(r["sequence_id"], set()).add(r["run_id"])
    assert len(by_sequence) == 2 and all(len(runs) == 1 for runs in by_sequence.values())

    named = f"boundary-kv:chunk_tokens=4,sequence_id=story,archive={archive}"
    assert cli("run", "Once upon a time", "-n", "4", "--engine", named).exit_code == 0
    before = cli("boundary", "ls", str(archive), "--output", "json").stdout
    again = cli("run", "The capital of France is", "-n", "4", "--engine", named)
    assert again.exit_code == 2
    assert "already holds sequence 'story'" in again.stderr and "sequence_id=" in again.stderr
    assert cli("boundary", "ls", str(archive), "--output", "json").stdout == before


def test_boundary_ls_errors_are_clean(cli, tmp_path: Path) -> None:
    missing = cli("boundary", "ls", str(tmp_path / "nowhere"))
    assert missing.exit_code == 2 and "error: no boundary archive" in missing.output
    bad_output = cli("boundary", "ls", str(tmp_path), "--output", "yaml")
    assert bad_output.exit_code == 2 and "--output" in bad_output.output
    empty = cli("boundary", "ls", str(tmp_path), "--output", "json")
    assert empty.exit_code == 0 and json.loads(empty.stdout) == []
