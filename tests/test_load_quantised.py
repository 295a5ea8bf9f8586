"""`--weights q8_0|q4_0`: a float model's matrices quantised into GGUF blocks at load. The blocks
are the `gguf` package's quantisation of the float weights, the float weights become the blocks'
dequantised values (prefill and decode use the same weights), and decoding through the blocks
is the float path of those weights up to the int16 rounding of the input."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from typer.testing import CliRunner

from larql.cli.app import app
from larql.inference.ffn import DenseFfn
from larql.inference.generation import next_token_logits
from larql.kernels.cpu import cpu_extension
from larql.kv import parse_engine
from larql.models import Model, load_model
from larql.models.errors import ModelError
from larql.models.model import WEIGHT_MODES
from larql.models.quantise import quantise_state
from tiny_models import build_tiny_model, random_ids

QTYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
# every width a multiple of 32: hidden 64, q_dim 64, intermediate 96
WIDE = dict(hidden_size=64, intermediate_size=96, head_dim=16)
MATRICES = {
    "wqkv": ("wq", "wk", "wv"),
    "wo": ("wo",),
    "w_gate_up": ("w_gate", "w_up"),
    "w_down": ("w_down",),
}

needs_kernels = pytest.mark.skipif(
    cpu_extension() is None, reason="the CPU block kernels are not built"
)


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # an untied and a tied LM head
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(f"wide-{request.param}")
    build_tiny_model(request.param, directory, **WIDE)
    return directory


def _float_copy(model: Model) -> Model:
    """The same (dequantised) float weights without their blocks: the float path."""
    copy = model.to(dtype=torch.float32)
    for lw in copy.weights.layers:
        lw.blocks = {}
    copy.weights.lm_head_blocks = None
    return copy


@pytest.mark.parametrize("mode", ["q8_0", "q4_0"])
def test_blocks_are_the_gguf_quantisation_and_the_float_weights(tiny_dir: Path, mode: str) -> None:
    original = load_model(str(tiny_dir), weights="float")
    model = load_model(str(tiny_dir), weights=mode)
    qtype = QTYPES[mode]
    for i, (lw, src) in enumerate(zip(model.weights.layers, original.weights.layers, strict=True)):
        assert set(lw.blocks) == set(MATRICES), i
        for name, rows in lw.blocks.items():
            assert rows.format == mode and rows.activation == "int16"
            # consistency: the float weights prefill reads are the blocks' values, exactly
            assert torch.equal(rows.dequantize(), getattr(lw, name)), (i, name)
            want = quantize(getattr(src, name).numpy(), qtype)  # fused rows quantise row-wise
            assert np.array_equal(rows.data.numpy(), want), (i, name)
    head = model.weights.lm_head_blocks
    assert head is not None and torch.equal(head.dequantize(), model.weights.lm_head)
    assert np.array_equal(head.data.numpy(), quantize(original.weights.lm_head.numpy(), qtype))
    tied = original.weights.lm_head.data_ptr() == original.weights.embed.data_ptr()
    assert (model.weights.lm_head.data_ptr() == model.weights.embed.data_ptr()) == tied
    assert not torch.equal(model.weights.layers[0].wo, original.weights.layers[0].wo)


def test_a_width_off_the_block_stays_float() -> None:
    state = {
        "embed": torch.randn(8, 48),
        "layers.0.wq": torch.randn(32, 48),
        "layers.0.w_down": torch.randn(48, 64),
        "layers.0.attn_norm": torch.randn(48),
    }
    replaced, blocks = quantise_state(state, "q4_0")
    assert set(blocks) == {"layers.0.w_down"}
    for name in ("embed", "layers.0.wq", "layers.0.attn_norm"):
        assert replaced[name] is state[name]
    assert torch.equal(replaced["layers.0.w_down"], blocks["layers.0.w_down"].dequantize())


def _decode(model: Model, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after a prefill of `ids`, and each step's logits [steps, V]."""
    ffn, engine = DenseFfn(model), parse_engine("standard").build(model)
    tokens, logits = [], []
    with torch.inference_mode():
        row = next_token_logits(model, engine.prefill(model, ffn, ids))
        for _ in range(steps):
            logits.append(row.reshape(-1))
            tokens.append(int(row.argmax()))
            row = next_token_logits(model, engine.decode_step(model, ffn, tokens[-1]))
    return tokens, torch.stack(logits)


@needs_kernels
@pytest.mark.parametrize("mode", ["q8_0", "q4_0"])
def test_decoding_through_the_blocks_is_the_float_path(tiny_dir: Path, mode: str) -> None:
    model = load_model(str(tiny_dir), weights=mode)
    ids = random_ids(12)
    tokens, logits = _decode(model, ids, 16)
    float_tokens, float_logits = _decode(_float_copy(model), ids, 16)
    assert tokens == float_tokens
    # int16 input codes move the tiny models' logits by ~7e-5 of their scale; quantising the
    # weights themselves moves them by ~0.6 of it
    scale = float_logits.abs().max()
    assert (logits - float_logits).abs().max() <= 5e-4 * scale
    assert not torch.equal(logits, float_logits)  # the blocks were read


@pytest.mark.slow
def test_requantising_a_quantised_gguf(smollm2: Model) -> None:
    model = load_model("smollm2-135m", weights="q4_0")
    rows = model.weights.layers[5].blocks["w_down"]
    assert rows.format == "q4_0"  # the file's Q4_1, re-quantised from its dequantised floats
    want = quantize(smollm2.weights.layers[5].w_down.numpy(), GGMLQuantizationType.Q4_0)
    assert np.array_equal(rows.data.numpy(), want)


def test_float64_keeps_the_quantised_values_without_blocks(tiny_dir: Path) -> None:
    model = load_model(str(tiny_dir), weights="q8_0", dtype="float64")
    assert model.weights.block_bytes == 0
    cpu = load_model(str(tiny_dir), weights="q8_0")
    assert torch.equal(model.weights.layers[1].w_down, cpu.weights.layers[1].w_down.double())


def test_an_unknown_mode_names_every_mode() -> None:
    with pytest.raises(ModelError) as error:
        load_model(weights="q2_k")
    assert f"accepted: {', '.join(WEIGHT_MODES)}" in str(error.value)
    assert "q8_0" in WEIGHT_MODES and "q4_0" in WEIGHT_MODES


def test_larql_run_with_q4_0(tiny_dir: Path) -> None:
    args = ["run", "w3 w4 w5 w6", "-m", str(tiny_dir), "-n", "4", "--output", "json"]
    result = CliRunner().invoke(app, [*args, "--weights", "q4_0"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(out["tokens"]) == 4


def test_the_fidelity_benchmark_runs_the_load_time_modes(
    tiny_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i}" for i in random_ids(40)))
    path = Path(__file__).parents[1] / "benchmarks" / "weights_fidelity.py"
    spec = importlib.util.spec_from_file_location("weights_fidelity", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = [
        "weights_fidelity.py",
        "--model",
        str(tiny_dir),
        "--modes",
        "q8_0,q4_0",
        "--prompt-len",
        "8",
        "--positions",
        "16",
        "--greedy",
        "8",
        "--text",
        str(text),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    module.main()
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert {"float", "q8_0", "q4_0"} <= set(rows)
    assert float(rows["q4_0"][1]) > 0  # a mean KL was measured against the float weights


def test_the_python_api_takes_the_load_time_modes(tiny_dir: Path) -> None:
    import larql

    model = larql.load_model(str(tiny_dir), weights="q4_0")
    assert model.weights.layers[0].blocks["w_down"].format == "q4_0"
