"""Engine state snapshots on the real default model: a state saved after a prefill and restored
into a fresh engine, or forked in memory, decodes exactly as the original goes on decoding; an
exact engine's restored state also agrees with a fresh prefill of the same tokens; a state
refuses another model, engine or spec, and `larql run --save-state/--load-state` continues a
prompt as one run of the whole text would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from larql.cli.app import app
from larql.inference.ffn import DenseFfn
from larql.inference.layer import final_logits
from larql.inference.snapshots import (
    SnapshotCorrupt,
    SnapshotMismatch,
    SnapshotNotFound,
    SnapshotUnsupported,
    SnapshotUnwritable,
)
from larql.kv import parse_engine
from larql.kv.resolve import ENV_VAR
from larql.kv.snapshots import restore_engine
from larql.models import Model

PROMPT = "The capital of France is Paris. The capital of Germany is"
STEPS = 4
SNAPSHOTTING = [
    "standard",
    "standard:window=8",
    "standard:window=8,sinks=2",
    "no-cache",
    "markov-rs:window=4",
    "markov-rs-codec:window=4",
    "boundary-per-layer:window=4",
    "turbo-quant",
    "kv-quant",
    "windowed-checkpoint:window=8",
    "boundary-kv",
    "snapkv",
    "h2o",
]
# exact against `standard` here: a fresh prefill of the same tokens gives the same logits
EXACT = ["standard", "no-cache", "markov-rs:window=4", "boundary-kv", "windowed-checkpoint"]


def decode(engine, model: Model, tokens: list[int]) -> list[torch.Tensor]:
    ffn = DenseFfn(model)
    with torch.inference_mode():
        return [final_logits(model, engine.decode_step(model, ffn, t))[0] for t in tokens]


def prefilled(spec: str, model: Model, ids: list[int]):
    engine = parse_engine(spec).build(model)
    with torch.inference_mode():
        hidden = engine.prefill(model, DenseFfn(model), ids)
    return engine, hidden


@pytest.mark.parametrize("spec", SNAPSHOTTING)
def test_restored_state_decodes_as_the_original(spec: str, smollm2: Model, tmp_path: Path):
    ids = smollm2.tokenizer.encode(PROMPT)
    engine, hidden = prefilled(spec, smollm2, ids)
    saved = engine.snapshot(tmp_path / "state", smollm2, ids, hidden)
    assert saved.nbytes > 0 and saved.manifest.position == len(ids)
    restored, loaded = restore_engine(tmp_path / "state", smollm2)
    assert type(restored) is type(engine) and restored.position == len(ids)
    assert loaded.manifest.token_ids == ids
    assert loaded.hidden is not None and torch.equal(loaded.hidden, hidden)
    continuation = [int(final_logits(smollm2, hidden)[0].argmax()), 11, 260, 3575]
    going_on = decode(engine, smollm2, continuation)
    for a, b in zip(going_on, decode(restored, smollm2, continuation), strict=True):
        assert torch.equal(a, b)
    assert restored.position == engine.position == len(ids) + STEPS


@pytest.mark.parametrize("spec", EXACT)
def test_restored_exact_engine_matches_a_fresh_prefill(spec: str, smollm2: Model, tmp_path):
    ids = smollm2.tokenizer.encode(PROMPT)
    engine, _ = prefilled(spec, smollm2, ids)
    engine.snapshot(tmp_path, smollm2, ids)
    restored, _ = restore_engine(tmp_path, smollm2)
    more = [11, 260, 3575]
    last = decode(restored, smollm2, more)[-1]
    _, fresh = prefilled("standard", smollm2, ids + more)
    reference = final_logits(smollm2, fresh)[0]
    assert (last - reference).abs().max().item() <= 1e-3
    assert int(last.argmax()) == int(reference.argmax())


def test_fork_is_independent_of_the_original(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(PROMPT)
    engine, _ = prefilled("markov-rs:window=4", smollm2, ids)
    fork = engine.fork()
    decode(engine, smollm2, [42, 43, 44])  # the original moves on with other tokens
    alone, _ = prefilled("markov-rs:window=4", smollm2, ids)
    for a, b in zip(
        decode(fork, smollm2, [11, 260]), decode(alone, smollm2, [11, 260]), strict=True
    ):
        assert torch.equal(a, b)
    assert fork.position == len(ids) + 2 and engine.position == len(ids) + 3


def test_retrieval_engine_refuses(smollm2: Model, tmp_path: Path) -> None:
    engine = parse_engine("apollo").build(smollm2)
    with pytest.raises(SnapshotUnsupported, match="apollo cannot snapshot"):
        engine.snapshot(tmp_path, smollm2)
    assert not (tmp_path / "manifest.json").exists()


def test_state_refuses_another_model_engine_or_spec(
    smollm2: Model, smollm2_f64: Model, tmp_path: Path
) -> None:
    ids = smollm2.tokenizer.encode(PROMPT)
    engine, _ = prefilled("standard:window=8", smollm2, ids)
    engine.snapshot(tmp_path, smollm2, ids)
    with pytest.raises(SnapshotMismatch, match="float64"):
        restore_engine(tmp_path, smollm2_f64)
    with pytest.raises(SnapshotMismatch, match="markov-rs"):
        restore_engine(tmp_path, smollm2, parse_engine("markov-rs"))
    with pytest.raises(SnapshotMismatch, match="standard:window=8"):
        restore_engine(tmp_path, smollm2, parse_engine("standard"))


def test_missing_or_corrupt_state_is_a_typed_error(smollm2: Model, tmp_path: Path) -> None:
    with pytest.raises(SnapshotNotFound):
        restore_engine(tmp_path / "nowhere", smollm2)
    ids = smollm2.tokenizer.encode(PROMPT)
    engine, _ = prefilled("standard", smollm2, ids)
    engine.snapshot(tmp_path, smollm2, ids)
    (tmp_path / "state.safetensors").write_bytes(b"not tensors")
    with pytest.raises(SnapshotCorrupt):
        restore_engine(tmp_path, smollm2)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(SnapshotCorrupt):
        restore_engine(tmp_path, smollm2)
    blocked = tmp_path / "manifest.json" / "state"  # under a file: no directory can be made
    with pytest.raises(SnapshotUnwritable, match=f"cannot write the state into {blocked}"):
        engine.snapshot(blocked, smollm2, ids)


def test_a_residual_store_of_the_per_layer_layout_is_refused(
    smollm2: Model, tmp_path: Path
) -> None:
    """A state whose residual store keeps one hot tier per layer (larql before the tiers held
    every layer's rows together) is a typed error that says so, not a store that fails later."""
    ids = smollm2.tokenizer.encode(PROMPT)
    engine, _ = prefilled("markov-rs-codec:window=4", smollm2, ids)
    engine.snapshot(tmp_path, smollm2, ids)
    manifest = json.loads((tmp_path / "manifest.json").read_text())

    def per_layer(node: object) -> int:
        """Make every residual store's hot tier a list, as the old layout had it → how many."""
        if isinstance(node, list):
            return sum(per_layer(v) for v in node)
        if not isinstance(node, dict):
            return 0
        if str(node.get("__object__", "")).endswith(":ResidualStore"):
            pairs = node["state"]["__dict__"]
            for pair in pairs:
                if pair[0] == "hot":
                    pair[1] = [pair[1]]
            return 1
        return sum(per_layer(v) for v in node.values())

    assert per_layer(manifest) == 1
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SnapshotCorrupt, match="older larql"):
        restore_engine(tmp_path, smollm2)


def run_cli(monkeypatch: pytest.MonkeyPatch, *args: str):
    monkeypatch.delenv(ENV_VAR, raising=False)
    return CliRunner().invoke(app, ["run", *args, "--weights", "float", "--output", "json"])


@pytest.mark.slow
def test_cli_load_state_continues_like_one_run(
    monkeypatch: pytest.MonkeyPatch, smollm2: Model, tmp_path: Path
) -> None:
    document, question = "The capital of France is Paris.", " The capital of Italy is"
    tok = smollm2.tokenizer
    assert tok.encode(document) + tok.encode(question) == tok.encode(document + question)
    engine = ["--engine", "markov-rs:window=4"]
    saved = run_cli(monkeypatch, document, "-n", "1", *engine, "--save-state", str(tmp_path))
    assert saved.exit_code == 0, saved.output
    assert "saved state" in saved.stderr
    loaded = run_cli(monkeypatch, question, "-n", "8", "--load-state", str(tmp_path))
    assert loaded.exit_code == 0, loaded.output
    whole = run_cli(monkeypatch, document + question, "-n", "8", *engine)
    tokens = [json.loads(r.stdout.strip().splitlines()[-1])["tokens"] for r in (loaded, whole)]
    assert tokens[0] == tokens[1]


def test_cli_state_errors_are_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result = run_cli(monkeypatch, "Hi", "--load-state", str(tmp_path / "nowhere"))
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("error: no saved state")
    assert "Traceback" not in result.output
