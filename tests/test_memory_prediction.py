"""`larql memory`: each engine's bytes counted by its own code over the model's structure on the
meta device equal what a real run of the same length reports (`Generation.memory_breakdown`,
`larql run --output json`'s `memory`), tier by tier and the reserve too; the structure has the
loaded model's shapes and reads no weight."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from larql.api import generate, parse_engine
from larql.cli.app import app
from larql.cli.common import EXIT_USER_ERROR
from larql.harness.memory import default_memory_specs, predict_memory
from larql.kv.catalog import CATALOG
from larql.models import Model, load_model
from larql.models.hf_loader import hf_config, hf_state_dict, read_hf_config
from larql.models.structure import config_shapes, load_structure
from tiny_models import build_tiny_model, random_ids

PROMPT = 40  # longer than the bench sweeps' windows of 4, so every windowed path runs
NEW = 3  # a prefill and two decode steps


def prompt_ids(n: int) -> list[int]:
    return [(i * 7919) % 40_000 + 100 for i in range(n)]


# budgets and sinks that evict within the prompt (the default specs' are sized for thousands)
EVICTING = [
    "standard:window=8,sinks=4",
    "snapkv:budget=16",
    "h2o:budget=16,recent=8",
    # dropping rows from a quantised store while decoding (the quantiser's sinks the policy's)
    "h2o:budget=16,recent=8,sinks=4+turbo-quant:bits=4",
    "tova:budget=16+kv-quant:bits=4",
]


def live_specs() -> list[str]:
    """What `larql memory` counts by default, every live engine as bench runs it, and the
    evicting engines evicting."""
    bench = [CATALOG.parse(s) for s in CATALOG.default_specs("bench")]
    live = [s.spec() for s in bench if s.live_decode]
    return list(dict.fromkeys(default_memory_specs() + live + EVICTING))


# long: a spec whose store another case here counts with more of it in use over this run (its
# budget, window or chunk past the run's 43 positions, so it holds what the acting case's store
# holds before it acts), or the same store at another code width
REPEATS = {
    "standard:window=512,sinks=4": "standard:window=8,sinks=4 windows the same buffer",
    "turbo-quant:bits=2": "turbo-quant (4 bits) and bits=3 code the same store",
    "snapkv": "snapkv:budget=16 counts the same store, evicting",
    "snapkv:budget=512": "snapkv:budget=16 counts the same store, evicting",
    "snapkv:budget=64": "snapkv:budget=16 counts the same store, evicting",
    "h2o:budget=64,recent=32": "h2o:budget=16,recent=8 counts the same store, evicting",
    "boundary-per-layer": "boundary-per-layer:window=4 counts the same store, its cold tier in use",
    "markov-rs": "markov-rs:window=4 counts the same store, its cold tier in use",
    "markov-rs-codec": "markov-rs-codec:window=4 counts the same store, its cold rows coded",
    "windowed-checkpoint": "windowed-checkpoint:window=4 counts the same store, checkpointing",
    "boundary-kv": "boundary-kv:chunk_tokens=4 counts the same store, its frames emitted",
}


def run_report_cases() -> list[object]:
    return [
        pytest.param(spec, marks=pytest.mark.long) if spec in REPEATS else spec
        for spec in live_specs()
    ]


@pytest.fixture(scope="module")
def structure() -> Model:
    return load_structure()


@pytest.mark.parametrize("spec", run_report_cases())
@pytest.mark.slow
def test_the_prediction_is_the_run_report(spec: str, structure: Model, smollm2_default: Model):
    """The default model as `larql run` loads it: the same bytes in every tier and reserve."""
    ids = prompt_ids(PROMPT)
    run = generate(smollm2_default, spec, ids, max_new_tokens=NEW)
    assert run.finish_reason == "length" and len(run.token_ids) == NEW  # no early stop
    (predicted,) = predict_memory(structure, [parse_engine(spec)], PROMPT, NEW)
    assert predicted.error is None
    assert predicted.memory == run.memory_breakdown
    assert predicted.memory.as_json() == run.as_json()["memory"]
    assert predicted.positions == PROMPT + NEW - 1
    fp16 = smollm2_default.config.kv_bytes_per_token(2) * predicted.positions
    assert predicted.fp16_full_bytes == fp16


def test_every_live_engine_is_counted_by_default() -> None:
    names = {CATALOG.parse(s).entry.name for s in default_memory_specs()}
    assert names == {e.name for e in CATALOG.entries if e.live_decode}
    assert "standard" in default_memory_specs()


def test_the_structure_has_the_loaded_model_shapes(structure: Model, smollm2_default: Model):
    real, meta = smollm2_default.weights, structure.weights
    assert structure.config == smollm2_default.config
    assert meta.device.type == "meta" and meta.dtype == real.dtype
    for mine, theirs in zip(meta.layers, real.layers, strict=True):
        for a, b in zip(mine.tensors(), theirs.tensors(), strict=True):
            assert (a.shape, a.dtype) == (b.shape, b.dtype)
    assert meta.embed.shape == real.embed.shape and meta.lm_head.shape == real.lm_head.shape


# long: the optional second model; test_an_hf_directory_from_its_headers[gemma3] counts a
# Gemma 3's sliding layers beside its global ones the same way
@pytest.mark.long
def test_the_second_model_too(gemma3: Model) -> None:
    """Gemma 3's GGUF: sliding layers beside global ones, one K/V head."""
    structure, ids = load_structure("gemma3-270m"), prompt_ids(PROMPT)
    for spec in ("standard", "markov-rs:window=16", "turbo-quant", "h2o:budget=16,recent=8"):
        run = generate(gemma3, spec, ids, max_new_tokens=NEW)
        (predicted,) = predict_memory(structure, [parse_engine(spec)], PROMPT, NEW)
        assert predicted.memory == run.memory_breakdown, spec


@pytest.mark.parametrize("arch", ["gemma3", "qwen2_moe", "gemma4_shared"])
def test_an_hf_directory_from_its_headers(arch: str, tmp_path: Path) -> None:
    """Sliding layers, experts (routed on meta without values) and layers sharing K/V: the
    prediction from the safetensors headers is a real run's."""
    build_tiny_model(arch, tmp_path)
    real, meta = load_model(str(tmp_path)), load_structure(str(tmp_path))
    ids = random_ids(12)
    for spec in ("standard", "markov-rs:window=4", "turbo-quant:bits=4", "h2o:budget=8,recent=4"):
        run = generate(real, spec, ids, max_new_tokens=NEW)
        (predicted,) = predict_memory(meta, [parse_engine(spec)], len(ids), len(run.token_ids))
        assert predicted.memory == run.memory_breakdown, (arch, spec)


def test_scorers_reading_a_long_prompt_in_parts_count_it_whole_on_meta(tmp_path: Path) -> None:
    """Past the query chunks of the attention scores and kvzip's reconstruction chunk, a real
    run scores in parts and the meta count in one pass: the same bytes."""
    build_tiny_model("llama", tmp_path, max_position_embeddings=1024)
    real, meta = load_model(str(tmp_path)), load_structure(str(tmp_path))
    ids = random_ids(600)
    for spec in ("kvzip:keep=0.25,layers=adaptive", "h2o:budget=64,recent=16"):
        run = generate(real, spec, ids, max_new_tokens=NEW)
        (predicted,) = predict_memory(meta, [parse_engine(spec)], len(ids), len(run.token_ids))
        assert predicted.memory == run.memory_breakdown, spec


def test_config_json_alone_gives_the_headers_shapes(tmp_path: Path) -> None:
    """Without weight files, the shapes come from config.json: those the headers give."""
    build_tiny_model("llama", tmp_path)
    config = hf_config(read_hf_config(tmp_path), "tiny")
    from_headers = {k: tuple(t.shape) for k, t in hf_state_dict(tmp_path, config, True).items()}
    assert config_shapes(config) == from_headers


LLAMA_70B = {
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


def test_a_70b_config_is_counted_in_seconds_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    start = time.perf_counter()
    structure = load_structure(str(tmp_path), "bfloat16")
    specs = [parse_engine(s) for s in ("standard", "standard:window=512,sinks=4", "h2o")]
    rows = predict_memory(structure, specs, 4096)
    assert time.perf_counter() - start < 60  # (a few seconds; a real load would not fit)
    standard = rows[0].memory
    assert standard is not None
    # 80 layers × K and V × 8 heads × 128 × 2 bytes, for 4096 positions
    assert standard.state == standard.hot == 80 * 2 * 8 * 128 * 2 * 4096
    assert rows[0].ratio_vs_fp16_full == 1.0
    assert all(row.memory is not None and row.memory.state < standard.state for row in rows[1:])


def test_the_command(tmp_path: Path) -> None:
    runner = CliRunner()
    done = runner.invoke(
        app,
        ["memory", "--prompt-tokens", "64", "--engine", "standard;no-cache", "--output", "json"],
    )
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert [row["engine"] for row in report["engines"]] == ["standard", "no-cache"]
    standard = report["engines"][0]
    assert standard["positions"] == 64 and standard["memory"]["state_bytes"] > 0
    assert set(standard["memory"]) == {
        "state_bytes",
        "hot_bytes",
        "cold_bytes",
        "derivative_bytes",
        "reserve_bytes",
        "held_bytes",
    }
    table = runner.invoke(
        app, ["memory", "--prompt-tokens", "64", "-n", "4", "--engine", "standard"]
    )
    assert table.exit_code == 0 and "standard" in table.stdout and "67" in table.stdout
    for bad in (
        [],
        ["--prompt-tokens", "0"],
        ["--prompt-tokens", "8", "--output", "yaml"],
        ["--prompt-tokens", "100000"],
        ["--prompt-tokens", "8", "--engine", "nope"],
    ):
        refused = runner.invoke(app, ["memory", *bad])
        assert refused.exit_code == EXIT_USER_ERROR, (bad, refused.output)


def test_a_boundary_frame_on_meta_writes_nothing(tmp_path: Path, structure: Model) -> None:
    """boundary-kv's frames (here: an archive directory) carry values: on the meta device none
    is made, and its bytes are its inner engine's."""
    archive = tmp_path / "frames"
    spec = parse_engine(f"boundary-kv:chunk_tokens=8,archive={archive}")
    (row,) = predict_memory(structure, [spec], 32)
    assert (
        row.error is None
        and row.memory == predict_memory(structure, [parse_engine("standard")], 32)[0].memory
    )
    assert not archive.exists() or not any(archive.iterdir())
    assert torch.device("meta") == structure.device
