"""Engine states on the real default model: a state saved after a prompt and a few decode steps
and loaded back, or forked in memory, decodes exactly as the original goes on decoding; an exact
engine's restored state also agrees with a fresh prefill of the same tokens; a state refuses
another model, engine, spec or version of its state, an older format, and tensors its spec does
not imply; and `larql run --save-state/--load-state` (or `larql.generate` with a `State`)
continues a prompt as one run of the whole text would."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import larql
from larql.cli.app import app
from larql.inference.ffn import DenseFfn
from larql.inference.layer import final_logits
from larql.inference.snapshots import (
    SnapshotCorrupt,
    SnapshotMismatch,
    SnapshotNotFound,
    SnapshotUnsupported,
    SnapshotUnwritable,
    declared_state,
)
from larql.inference.snapshots.store import manifest_digest
from larql.kv import parse_engine
from larql.kv.resolve import ENV_VAR
from larql.kv.snapshots import State
from larql.kv.standard import StandardEngine
from larql.models import Model

PROMPT = "The capital of France is Paris. The capital of Germany is"
STEPS = 4
LONG = pytest.mark.long
SNAPSHOTTING = [
    "standard",
    "standard:window=8",
    "standard:window=8,sinks=2",
    "no-cache",
    "markov-rs:window=4",
    "markov-rs:window=4,kv_cache=0",
    "markov-rs-codec:window=4",
    "boundary-per-layer:window=4",
    "turbo-quant",
    "turbo-quant:bits=3",
    "kv-quant",
    "kv-quant:recent=4,sinks=2,recent_bits=8",
    "kv-quant:format=fp8",
    "windowed-checkpoint:window=8",
    "boundary-kv:chunk_tokens=4",
    "snapkv:budget=4,window=2",
    "h2o:budget=6,recent=2",
    "snapkv:budget=4,window=2+turbo-quant",
    "snapkv:budget=4,window=2+kv-quant:sinks=2,recent=2",
    "h2o:budget=6,recent=2+turbo-quant",
    "tova:budget=6,sinks=1,recent=2,heads=adaptive+kv-quant:bits=4,sinks=2,recent=2",
    "semantic-promotion:base=markov-rs-codec:window=4",
]
# the round trip on the CPU: one spec per engine family and store in `make test`; the rest
# (another option of a store a kept spec already round-trips) in `make test-all`
ROUND_TRIP = [
    "standard",
    # long: window=8,sinks=2 below round-trips the same windowed buffer
    pytest.param("standard:window=8", marks=LONG),
    "standard:window=8,sinks=2",
    # long: test_restored_exact_engine_matches_a_fresh_prefill[no-cache] restores it (a fork
    # goes through the same declared state)
    pytest.param("no-cache", marks=LONG),
    "markov-rs:window=4",
    # long: test_prefix_cache's cut of markov-rs:kv_cache=0 forks this state and continues it
    # exactly; markov-rs:window=4 above round-trips the same engine
    pytest.param("markov-rs:window=4,kv_cache=0", marks=LONG),
    # long: semantic-promotion below round-trips this very engine as its base
    pytest.param("markov-rs-codec:window=4", marks=LONG),
    "boundary-per-layer:window=4",
    # long: bits=3 below round-trips the same store
    pytest.param("turbo-quant", marks=LONG),
    "turbo-quant:bits=3",
    # long: recent=4,sinks=2,recent_bits=8 below round-trips the same store, with more in it
    pytest.param("kv-quant", marks=LONG),
    "kv-quant:recent=4,sinks=2,recent_bits=8",
    # long: fp8 codes are bytes of the same store as the kv-quant spec above
    pytest.param("kv-quant:format=fp8", marks=LONG),
    "windowed-checkpoint:window=8",
    "boundary-kv:chunk_tokens=4",
    # long: test_eviction_scorers' restored states (tova, h2o, kvzip, …) cover the eviction
    # stores; the compositions below cover snapkv's and h2o's rows under a quantiser
    pytest.param("snapkv:budget=4,window=2", marks=LONG),
    pytest.param("h2o:budget=6,recent=2", marks=LONG),
    # long: snapkv+kv-quant below holds the same kept codes, h2o+turbo-quant turbo-quant's
    pytest.param("snapkv:budget=4,window=2+turbo-quant", marks=LONG),
    "snapkv:budget=4,window=2+kv-quant:sinks=2,recent=2",
    "h2o:budget=6,recent=2+turbo-quant",
    # long: test_composed's forks_and_batches[tova:…+kv-quant:bits=4] forks the same ragged
    # store through its declared state and decodes as the original
    pytest.param(
        "tova:budget=6,sinks=1,recent=2,heads=adaptive+kv-quant:bits=4,sinks=2,recent=2",
        marks=LONG,
    ),
    "semantic-promotion:base=markov-rs-codec:window=4",
]
# exact against `standard` here: a fresh prefill of the same tokens gives the same logits
EXACT = ["standard", "no-cache", "markov-rs:window=4", "boundary-kv", "windowed-checkpoint"]


def decode(engine, model: Model, tokens: list[int]) -> list[torch.Tensor]:
    ffn = DenseFfn(model)
    with torch.inference_mode():
        return [final_logits(model, engine.decode_step(model, ffn, t))[0] for t in tokens]


def stepped(spec: str, model: Model, ids: list[int], steps: list[int]) -> State:
    """The state after the prompt and a few decode steps."""
    state = larql.prefill(model, spec, ids)
    ffn = DenseFfn(model)
    hidden = state.hidden
    with torch.inference_mode():
        for token in steps:
            hidden = state.engine.decode_step(model, ffn, token)
    return State(model, state.engine, hidden, (*ids, *steps))


@pytest.mark.parametrize("spec", ROUND_TRIP)
def test_restored_and_forked_states_decode_as_the_original(
    spec: str, smollm2: Model, tmp_path: Path
) -> None:
    ids = smollm2.tokenizer.encode(PROMPT)
    state = stepped(spec, smollm2, ids, [11, 260])
    saved = state.save(tmp_path / "state")
    assert saved.nbytes > 0 and saved.manifest.position == len(ids) + 2
    restored = larql.load_state(smollm2, tmp_path / "state")
    fork = state.fork()
    assert type(restored.engine) is type(state.engine) and restored.position == len(ids) + 2
    assert restored.token_ids == state.token_ids and torch.equal(restored.hidden, state.hidden)
    continuation = [int(state.logits().argmax()), 11, 260, 3575]
    going_on = decode(state.engine, smollm2, continuation)
    for other in (restored, fork):
        for a, b in zip(going_on, decode(other.engine, smollm2, continuation), strict=True):
            assert torch.equal(a, b)
    assert restored.position == state.position == len(ids) + 2 + STEPS


@pytest.mark.parametrize("window", [None, 6], ids=["all", "window"])
def test_the_static_path_declares_the_eager_state_and_forks(
    window: int | None, smollm2: Model
) -> None:
    """`standard`'s static cache (its CUDA graph path, run eagerly here) declares the rows the
    eager path holds, and a fork of it is a static cache that decodes as the original."""
    ids = smollm2.tokenizer.encode(PROMPT)
    ffn = DenseFfn(smollm2)
    static, eager = StandardEngine(window=window, static=True), StandardEngine(window=window)
    with torch.inference_mode():
        for engine in (static, eager):
            engine.prefill(smollm2, ffn, ids)
            for token in (11, 260):
                engine.decode_step(smollm2, ffn, token)
    held, reference = declared_state(static).tensors, declared_state(eager).tensors
    assert held.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(held[name], tensor, rtol=1e-3, atol=1e-4)  # masked vs windowed
    fork = static.fork(smollm2)
    assert fork.fast_path is not None and fork.position == static.position
    continuation = [3575, 11, 260]
    going_on, forked = decode(static, smollm2, continuation), decode(fork, smollm2, continuation)
    for a, b in zip(going_on, forked, strict=True):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def smollm2_cuda() -> Model:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return larql.load_model("smollm2-135m", dtype=torch.float32, weights="float", device="cuda")


@pytest.mark.parametrize("spec", SNAPSHOTTING)
def test_states_on_cuda_restore_and_fork_as_the_original(
    spec: str, smollm2_cuda: Model, tmp_path: Path
) -> None:
    """The same round trip with every tensor on the GPU (its graph and kernel paths included)."""
    test_restored_and_forked_states_decode_as_the_original(spec, smollm2_cuda, tmp_path)


@pytest.mark.parametrize("spec", EXACT)
def test_restored_exact_engine_matches_a_fresh_prefill(spec: str, smollm2: Model, tmp_path):
    ids = smollm2.tokenizer.encode(PROMPT)
    larql.prefill(smollm2, spec, ids).save(tmp_path)
    restored = larql.load_state(smollm2, tmp_path)
    more = [11, 260, 3575]
    last = decode(restored.engine, smollm2, more)[-1]
    reference = larql.prefill(smollm2, "standard", ids + more).logits()
    assert (last - reference).abs().max().item() <= 1e-3
    assert int(last.argmax()) == int(reference.argmax())


def test_fork_is_independent_of_the_original(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(PROMPT)
    state = larql.prefill(smollm2, "markov-rs:window=4", ids)
    fork = state.fork()
    decode(state.engine, smollm2, [42, 43, 44])  # the original moves on with other tokens
    alone = larql.prefill(smollm2, "markov-rs:window=4", ids)
    for a, b in zip(
        decode(fork.engine, smollm2, [11, 260]),
        decode(alone.engine, smollm2, [11, 260]),
        strict=True,
    ):
        assert torch.equal(a, b)
    assert fork.position == len(ids) + 2 and state.position == len(ids) + 3


def test_generate_continues_a_state_and_leaves_it_as_it_was(smollm2: Model) -> None:
    document, question = "The capital of France is Paris.", " The capital of Italy is"
    tok = smollm2.tokenizer
    assert tok.encode(document) + tok.encode(question) == tok.encode(document + question)
    state = larql.prefill(smollm2, "markov-rs:window=4", document)
    first = larql.generate(smollm2, state, question, max_new_tokens=6)
    again = larql.generate(smollm2, state, question, max_new_tokens=6)
    whole = larql.generate(smollm2, "markov-rs:window=4", document + question, max_new_tokens=6)
    assert first.token_ids == again.token_ids == whole.token_ids
    assert state.position == len(tok.encode(document))


def test_a_built_engine_or_an_engine_without_a_spec_is_refused(smollm2: Model, tmp_path) -> None:
    engine = larql.parse_engine("standard").build(smollm2)
    with pytest.raises(larql.InvalidInput, match=r"larql\.State"):
        larql.generate(smollm2, engine, "Hi")
    bare = StandardEngine()  # built without a spec: nothing could rebuild it
    hidden = bare.prefill(smollm2, DenseFfn(smollm2), [1, 2, 3])
    with pytest.raises(SnapshotUnsupported, match="not built from a spec"):
        State(smollm2, bare, hidden).save(tmp_path)


def test_retrieval_engine_refuses(smollm2: Model) -> None:
    engine = parse_engine("apollo").build(smollm2)
    with pytest.raises(SnapshotUnsupported, match="apollo cannot snapshot"):
        declared_state(engine)


def test_state_refuses_another_model_engine_spec_or_version(
    smollm2: Model, smollm2_f64: Model, tmp_path: Path
) -> None:
    ids = smollm2.tokenizer.encode(PROMPT)
    larql.prefill(smollm2, "standard:window=8", ids).save(tmp_path)
    with pytest.raises(SnapshotMismatch, match="float64"):
        larql.load_state(smollm2_f64, tmp_path)
    with pytest.raises(SnapshotMismatch, match="markov-rs"):
        larql.load_state(smollm2, tmp_path, engine="markov-rs")
    with pytest.raises(SnapshotMismatch, match="standard:window=8"):
        larql.load_state(smollm2, tmp_path, engine="standard")
    reseal(tmp_path, state_version=2)
    with pytest.raises(SnapshotMismatch, match="version 2 of standard's state"):
        larql.load_state(smollm2, tmp_path)


def reseal(directory: Path, **changes: object) -> None:
    """Change manifest entries and recompute its digest (as a deliberate edit would)."""
    document = json.loads((directory / "manifest.json").read_text())
    document.update(changes)
    document.pop("digest")
    document["digest"] = manifest_digest(document)
    (directory / "manifest.json").write_text(json.dumps(document))


def test_missing_or_corrupt_state_is_a_typed_error(smollm2: Model, tmp_path: Path) -> None:
    with pytest.raises(SnapshotNotFound):
        larql.load_state(smollm2, tmp_path / "nowhere")
    ids = smollm2.tokenizer.encode(PROMPT)
    state = larql.prefill(smollm2, "standard", ids)
    state.save(tmp_path)
    (tmp_path / "state.safetensors").write_bytes(b"not tensors")
    with pytest.raises(SnapshotCorrupt, match="not the tensor file"):
        larql.load_state(smollm2, tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(SnapshotCorrupt, match="does not read as JSON"):
        larql.load_state(smollm2, tmp_path)
    blocked = tmp_path / "manifest.json" / "state"  # under a file: no directory can be made
    with pytest.raises(SnapshotUnwritable, match=f"cannot write the state into {blocked}"):
        state.save(blocked)


def test_a_state_of_the_older_format_is_refused_in_one_line(smollm2: Model, tmp_path: Path) -> None:
    """States before declared data held a generic object graph that named classes to rebuild;
    this larql never reads one."""
    ids = smollm2.tokenizer.encode(PROMPT)
    larql.prefill(smollm2, "standard", ids).save(tmp_path)
    document = json.loads((tmp_path / "manifest.json").read_text())
    document["format"] = "larql-engine-state/1"
    (tmp_path / "manifest.json").write_text(json.dumps(document))
    with pytest.raises(SnapshotCorrupt, match="older larql") as refused:
        larql.load_state(smollm2, tmp_path)
    assert "\n" not in str(refused.value)


def test_tensors_the_spec_does_not_imply_are_refused(smollm2: Model, tmp_path: Path) -> None:
    """With its digests recomputed, a state edited to hold another shape is still refused: each
    tensor is checked against what the spec and the model imply."""
    ids = smollm2.tokenizer.encode(PROMPT)
    larql.prefill(smollm2, "standard", ids).save(tmp_path)
    tensors = load_file(tmp_path / "state.safetensors")
    tensors["engine.layers.3.k"] = tensors["engine.layers.3.k"][:-1].clone()
    save_file(tensors, tmp_path / "state.safetensors")
    digest = hashlib.sha256((tmp_path / "state.safetensors").read_bytes()).hexdigest()
    reseal(tmp_path, tensors_sha256=digest)
    shapes = r"'layers\.3\.k' is float32 \[11, 3, 64\]; expected float32 \[12, 3, 64\]"
    with pytest.raises(SnapshotCorrupt, match=shapes):
        larql.load_state(smollm2, tmp_path)


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
    # the model `--weights float` loads, loaded once for the three runs
    monkeypatch.setattr("larql.cli.run_cmd.open_model", lambda *a, **k: smollm2)
    engine = ["--engine", "markov-rs:window=4"]
    saved = run_cli(monkeypatch, document, "-n", "1", *engine, "--save-state", str(tmp_path))
    assert saved.exit_code == 0, saved.output
    assert "saved state" in saved.stderr
    loaded = run_cli(monkeypatch, question, "-n", "4", "--load-state", str(tmp_path))
    assert loaded.exit_code == 0, loaded.output
    whole = run_cli(monkeypatch, document + question, "-n", "4", *engine)
    tokens = [json.loads(r.stdout.strip().splitlines()[-1])["tokens"] for r in (loaded, whole)]
    assert tokens[0] == tokens[1]


def test_cli_state_errors_are_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result = run_cli(monkeypatch, "Hi", "--load-state", str(tmp_path / "nowhere"))
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("error: no saved state")
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_cli_loads_a_state_saved_from_python(
    monkeypatch: pytest.MonkeyPatch, smollm2_default: Model, tmp_path: Path
) -> None:
    """The state `State.save` writes holds its last row: `--load-state` continues it with an
    empty prompt as the run that saved it would have gone on."""
    document = "The capital of France is Paris. The capital of Italy is"
    larql.prefill(smollm2_default, "standard", document).save(tmp_path)
    # the model `larql run` loads by default (`weights=auto`), loaded once by the fixture
    monkeypatch.setattr("larql.cli.run_cmd.open_model", lambda *a, **k: smollm2_default)
    loaded = CliRunner().invoke(
        app, ["run", "", "-n", "4", "--load-state", str(tmp_path), "--output", "json"]
    )
    assert loaded.exit_code == 0, loaded.output
    whole = larql.generate(smollm2_default, "standard", document, max_new_tokens=4)
    assert json.loads(loaded.stdout.strip().splitlines()[-1])["tokens"] == whole.token_ids


def test_a_state_whose_spec_names_a_path_loads_only_with_the_operators_engine(
    smollm2: Model, tmp_path: Path
) -> None:
    """A state's spec is parsed as untrusted input: one naming a path on the machine (or sizes
    past the model's) is refused, unless the caller names that same spec as its engine."""
    ids = smollm2.tokenizer.encode(PROMPT)
    larql.prefill(smollm2, "standard", ids).save(tmp_path / "state")
    archive = tmp_path / "archive"
    for spec in (f"boundary-kv:archive={archive}", "boundary-per-layer:layers=1000000"):
        reseal(tmp_path / "state", engine_spec=spec, engine=spec.split(":")[0])
        with pytest.raises(SnapshotCorrupt, match="will not build from a file"):
            larql.load_state(smollm2, tmp_path / "state")
    assert not archive.exists()
