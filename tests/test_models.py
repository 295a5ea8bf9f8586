"""Model resolution, GGUF parsing, the dequantized-weight cache, dtype conversion and the errors
a user sees for a missing or malformed model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from larql.cli.app import app
from larql.models import (
    Model,
    ModelFormatError,
    ModelNotFound,
    UnsupportedArchitecture,
    gguf_loader,
    load_model,
)
from larql.models.gguf_file import GgufFile
from larql.models.registry import resolve_model_path
from tiny_models import build_tiny_model, rewrite_config


@pytest.mark.slow
def test_header_and_tensors_match_gguf_reader(smollm2: Model) -> None:
    from gguf import GGUFReader

    ours = GgufFile(smollm2.source)
    reader = GGUFReader(smollm2.source)
    assert len(ours.tensors) == len(reader.tensors)
    assert ours.arch_key("block_count") == 30
    assert ours.get("tokenizer.ggml.tokens")[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for tensor in reader.tensors[:12]:
        info = ours.tensors[tensor.name]
        assert info.qtype == tensor.tensor_type
        assert np.array_equal(
            ours.raw_bytes(tensor.name), np.asarray(tensor.data).reshape(-1).view(np.uint8)
        )


def test_unknown_and_missing_models(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="unknown model 'nope'"):
        resolve_model_path("nope")
    with pytest.raises(ModelNotFound, match=r"without config\.json"):
        resolve_model_path(str(tmp_path))
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"1234")
    with pytest.raises(ModelNotFound, match=r"neither a \.gguf file"):
        resolve_model_path(str(not_gguf))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        load_model(str(fake))


def test_hf_directory_errors(tmp_path: Path) -> None:
    tiny = build_tiny_model("llama", tmp_path / "m")
    rewrite_config(tiny.directory, model_type="mamba")
    with pytest.raises(UnsupportedArchitecture, match="supported: llama"):
        load_model(str(tiny.directory))
    rewrite_config(tiny.directory, model_type="llama")
    (tiny.directory / "tokenizer.json").unlink()
    with pytest.raises(ModelFormatError, match=r"no tokenizer\.json"):
        load_model(str(tiny.directory))


def test_run_with_an_hf_directory_and_a_gguf_path(tmp_path: Path, smollm2: Model) -> None:
    build_tiny_model("qwen3", tmp_path / "qwen3")
    runner = CliRunner()
    result = runner.invoke(
        app, ["run", "w5 w6 w7", "-m", str(tmp_path / "qwen3"), "-n", "3", "-o", "json"]
    )
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["tokens"]) == 3
    result = runner.invoke(app, ["run", "Hi", "-m", str(smollm2.source), "-n", "2", "-o", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"] == smollm2.source.stem


@pytest.fixture(scope="module")
def first_load(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Model]:
    """A first load of the default model into an empty cache → the cache and the model."""
    root = tmp_path_factory.mktemp("larql-cache")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LARQL_CACHE_DIR", str(root))
        return root, load_model("smollm2-135m")


@pytest.mark.slow
def test_second_load_reads_the_weight_cache(
    first_load: tuple[Path, Model], monkeypatch: pytest.MonkeyPatch, smollm2: Model
) -> None:
    cache, first = first_load
    monkeypatch.setenv("LARQL_CACHE_DIR", str(cache))
    assert list((cache / "weights").glob("*.safetensors"))
    assert list((cache / "tokenizers").glob("*.json"))

    def no_dequantization(*args, **kwargs):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(gguf_loader, "gguf_state_dict", no_dequantization)
    monkeypatch.setattr("larql.models.model.gguf_state_dict", no_dequantization)
    second = load_model("smollm2-135m")
    assert torch.equal(first.weights.layers[3].wqkv, second.weights.layers[3].wqkv)
    assert torch.equal(second.weights.embed, smollm2.weights.embed)


@pytest.mark.slow
def test_corrupt_cache_is_rebuilt(
    first_load: tuple[Path, Model], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = shutil.copytree(first_load[0], tmp_path / "cache")  # the first load's cache
    monkeypatch.setenv("LARQL_CACHE_DIR", str(cache))
    (cached,) = (cache / "weights").glob("*.safetensors")
    cached.write_bytes(b"garbage")
    model = load_model("smollm2-135m")
    assert model.weights.embed.shape == (49152, 576)


@pytest.mark.slow
def test_dtype_conversion_keeps_the_model(smollm2: Model) -> None:
    bf16 = smollm2.to(dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    assert bf16.weights.layers[0].wqkv.dtype == torch.bfloat16
    assert bf16.weights.lm_head.data_ptr() == bf16.weights.embed.data_ptr()  # still tied
    back = bf16.to(dtype=torch.float32)
    assert (back.weights.layers[0].w_down - smollm2.weights.layers[0].w_down).abs().max() < 1e-2


def test_smollm2_config(smollm2: Model) -> None:
    cfg = smollm2.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_embeddings and cfg.max_positions == 8192
    assert {0, 2} <= smollm2.tokenizer.stop_ids  # <|endoftext|>, <|im_end|>


def test_gemma3_config(gemma3: Model) -> None:
    cfg = gemma3.config
    globals_ = [i for i, spec in enumerate(cfg.layers) if spec.sliding_window is None]
    assert globals_ == [5, 11, 17]
    assert {spec.sliding_window for spec in cfg.layers} == {None, 512}
    assert cfg.layers[0].rope.base == 10_000.0 and cfg.layers[5].rope.base == 1_000_000.0
    assert cfg.embed_scale == pytest.approx(640**0.5)
    assert gemma3.tokenizer.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
