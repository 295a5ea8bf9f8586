"""A tensor-parallel rank reads its share of an HF directory's weights alone: the tensors it
holds are exactly the whole state cut by `shard_state`, and the tensors the cut takes one slice
of are read from the files as that slice, never whole."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import larql.models.hf_loader as hf_loader
from larql.models import load_model
from larql.models.hf_loader import hf_config, hf_state_dict, read_hf_config
from larql.models.shard import TensorShard, shard_config, shard_state
from larql.models.weights import ModelWeights
from tiny_models import VOCAB, build_tiny_model, save_tokenizer

# a dense Llama, experts stored one by one (Mixtral), a shared expert (Qwen2-MoE), fused
# experts with their output bias (GPT-OSS), experts beside the MLP (Gemma 4), folded
# multipliers (Granite)
ARCHS = ["llama", "mixtral", "qwen2_moe", "gpt_oss", "gemma4_moe", "granite"]


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    built = {}
    for arch in ARCHS:
        built[arch] = tmp_path_factory.mktemp(f"tp-load-{arch}")
        build_tiny_model(arch, built[arch])
    return built


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rank_loads_the_whole_state_cut(
    directories: dict[str, Path], rank: int, dtype: torch.dtype
) -> None:
    directory = directories["llama"]
    config = hf_config(read_hf_config(directory))
    cut = shard_state(config, hf_state_dict(directory, config), rank, 2)
    expected = ModelWeights.from_state(shard_config(config, 2), cut, dtype)
    model = load_model(str(directory), dtype=dtype, shard=TensorShard(rank, 2))
    assert model.config == shard_config(hf_config(read_hf_config(directory), model.name), 2)
    held, wanted = _by_name(model.weights), _by_name(expected)
    assert held.keys() == wanted.keys()
    for name, tensor in wanted.items():
        assert held[name].dtype == dtype and torch.equal(held[name], tensor), name


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architectures_share_is_the_cut_of_its_whole_state(
    directories: dict[str, Path], arch: str
) -> None:
    directory = directories[arch]
    config = hf_config(read_hf_config(directory))
    whole = hf_state_dict(directory, config)
    for rank in (0, 1):
        cut = shard_state(config, whole, rank, 2)
        share = hf_state_dict(directory, config, share=(rank, 2), dtype=torch.bfloat16)
        assert share.keys() == cut.keys()
        for name, tensor in cut.items():
            assert torch.equal(share[name], tensor.to(torch.bfloat16)), name


class _SpyFile:
    """`safe_open` that counts the elements each tensor is read with, whole or as a slice."""

    def __init__(self, read: dict[str, int], *args: Any, **kwargs: Any) -> None:
        self._file = _real_safe_open(*args, **kwargs)
        self._read = read

    def __enter__(self) -> _SpyFile:
        self._open = self._file.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self._open.keys())

    def get_tensor(self, key: str) -> torch.Tensor:
        tensor = self._open.get_tensor(key)
        self._read[key] = self._read.get(key, 0) + tensor.numel()
        return tensor

    def get_slice(self, key: str) -> Any:
        return _SpySlice(self._open.get_slice(key), key, self._read)


class _SpySlice:
    def __init__(self, part: Any, key: str, read: dict[str, int]) -> None:
        self._part, self._key, self._read = part, key, read

    def get_dtype(self) -> str:
        return self._part.get_dtype()

    def get_shape(self) -> list[int]:
        return self._part.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self._part[index]
        self._read[self._key] = self._read.get(self._key, 0) + tensor.numel()
        return tensor


_real_safe_open = hf_loader.safe_open


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_a_rank_reads_its_rows_and_columns_alone(
    directories: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every matrix of the attention and the MLP (each expert's, for Mixtral) is read as the
    rank's half of its elements; the embeddings, LM head and norms whole; nothing twice."""
    directory = directories[arch]
    config = hf_config(read_hf_config(directory))
    read: dict[str, int] = {}
    monkeypatch.setattr(hf_loader, "safe_open", lambda *a, **k: _SpyFile(read, *a, **k))
    hf_state_dict(directory, config, share=(1, 2), dtype=torch.bfloat16)
    monkeypatch.undo()
    sizes: dict[str, int] = {}
    with _real_safe_open(next(directory.glob("*.safetensors")), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            sizes[key] = int(torch.Size(f.get_slice(key).get_shape()).numel())
    assert read.keys() == sizes.keys()
    split = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    split += (".w1.", ".w2.", ".w3.")
    halves = [key for key in sizes if any(part in key for part in split)]
    assert len(halves) == config.num_layers * (7 if arch == "llama" else 4 + 3 * 4)
    for key, numel in sizes.items():
        assert read[key] == (numel // 2 if key in halves else numel), key
    assert sum(read.values()) < sum(sizes.values())


def _by_name(weights: ModelWeights) -> dict[str, torch.Tensor]:
    """Every tensor `weights` holds, by where it sits."""
    held = {"embed": weights.embed, "lm_head": weights.lm_head, "final_norm": weights.final_norm}
    for i, layer in enumerate(weights.layers):
        held.update({f"{i}.{k}": t for k, t in vars(layer).items() if isinstance(t, torch.Tensor)})
    return held


def test_the_gpu_benchmarks_directories_load_alike_in_transformers_and_larql(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`benchmarks/tensor_parallel_gpu.py` writes HF shards with an index (here 4 of a tiny
    shape) that transformers reads as larql does; no value is NaN or Inf and no two rows of a
    matrix agree; a rank reads its share across the shards."""
    transformers = pytest.importorskip("transformers")
    path = Path(__file__).parents[1] / "benchmarks" / "tensor_parallel_gpu.py"
    spec = importlib.util.spec_from_file_location("tensor_parallel_gpu", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "tensor_parallel_gpu", bench)  # (its dataclasses look it up)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "SHARD_BYTES", 60_000)
    tokenizer = tmp_path / "tokenizer.json"
    save_tokenizer(tmp_path)
    built = bench.build("tiny", tmp_path / "tiny", tokenizer, workers=2)
    assert built["shards"] == 4 and built["vocab"] == VOCAB
    directory = tmp_path / "tiny"
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    hf_state = {k: v.float() for k, v in hf.state_dict().items()}
    model = load_model(str(directory))
    layer = model.weights.layers[1]
    assert torch.equal(layer.w_down, hf_state["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(model.weights.lm_head, hf_state["lm_head.weight"])
    for name, tensor in hf_state.items():
        assert torch.isfinite(tensor).all(), name
        if tensor.dim() == 2:
            assert torch.unique(tensor, dim=0).shape[0] == tensor.shape[0], name
    config = hf_config(read_hf_config(directory))
    cut = shard_state(config, hf_state_dict(directory, config), 1, 2)
    share = hf_state_dict(directory, config, share=(1, 2))
    assert all(torch.equal(share[name], t) for name, t in cut.items())
