"""GGUF block weights on the CPU: the pure-torch layouts against the `gguf` package, the compiled
block product against the float product, and the default model's greedy tokens through both."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

import larql.inference.linear as linear_module
from larql.data import default_text
from larql.harness.contexts import context_ids
from larql.inference.ffn import DenseFfn
from larql.inference.generation import next_token_logits
from larql.inference.linear import linear, reads_blocks
from larql.kernels.cpu.build import load as load_block_kernels
from larql.kv import parse_engine
from larql.models import Model, load_model
from larql.models.blocks import FORMAT_CODES, GGUF_FORMATS, BlockRows
from larql.models.errors import ModelError

FORMATS = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]


def _random_rows(qtype: GGMLQuantizationType, out: int, width: int, seed: int) -> BlockRows:
    weights = np.random.default_rng(seed).standard_normal((out, width)).astype(np.float32)
    return BlockRows.from_numpy(GGUF_FORMATS[qtype], quantize(weights, qtype), (out, width))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_dequantize_reads_the_gguf_layout(qtype: GGMLQuantizationType) -> None:
    rows = _random_rows(qtype, 8, 96, 0)
    want = dequantize(rows.data.numpy(), qtype)
    assert torch.equal(rows.dequantize(), torch.from_numpy(want))


@pytest.fixture(scope="module")
def float_smollm2(smollm2: Model) -> Model:
    return smollm2  # the session's model has float weights only


@pytest.fixture(scope="module")
def blocks_smollm2() -> Model:
    return load_model("smollm2-135m", weights="auto")


def test_the_default_models_blocks_are_its_float_weights(
    blocks_smollm2: Model, float_smollm2: Model
) -> None:
    layer = blocks_smollm2.weights.layers[3]  # weights="auto", the default
    if not layer.blocks:
        pytest.skip("the CPU block kernels are not built")
    assert set(layer.blocks) == {"wqkv", "wo", "w_gate_up", "w_down"}
    floats = float_smollm2.weights.layers[3]
    for name, rows in layer.blocks.items():  # fused, unpermuted rows: the same matrices
        assert torch.equal(rows.dequantize(), getattr(floats, name)), name
    blocks = blocks_smollm2.weights
    assert torch.equal(blocks.lm_head_blocks.dequantize(), float_smollm2.weights.lm_head)
    # Q4_1 layers and a Q8_0 head: 0.18× the float32 bytes one decode step reads
    assert blocks.decode_read_bytes() < 0.2 * float_smollm2.weights.decode_read_bytes()


def test_the_kernels_build_where_a_compiler_is(blocks_smollm2: Model, float_smollm2: Model) -> None:
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler: torch's float products are the path")
    assert load_block_kernels() is not None, "run `make setup` (python -m larql.kernels.cpu.build)"
    assert reads_blocks(blocks_smollm2) and not reads_blocks(float_smollm2)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("width", [32, 576, 1536])
def test_block_product_is_the_float_product(qtype: GGMLQuantizationType, width: int) -> None:
    kernels = load_block_kernels()
    if kernels is None:
        pytest.skip("the CPU block kernels are not built")
    rows = _random_rows(qtype, 200, width, width)
    x = torch.randn(width, generator=torch.Generator().manual_seed(1))
    got = kernels.block_gemv(x, rows.data, FORMAT_CODES[rows.format])
    want = rows.dequantize().double() @ x.double()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_linear_reads_the_blocks_and_falls_back_without_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows = _random_rows(GGMLQuantizationType.Q4_1, 64, 128, 2)
    weight, bias = rows.dequantize(), torch.randn(64)
    x = torch.randn(1, 128)
    want = F.linear(x, weight, bias)
    assert torch.allclose(linear(x, weight, bias, rows), want, rtol=1e-5, atol=1e-5)
    assert linear(x.bfloat16(), weight.bfloat16(), None, rows).dtype == torch.bfloat16
    monkeypatch.setattr(linear_module, "load_block_kernels", lambda: None)
    assert torch.allclose(linear(x, weight, bias, rows), want, rtol=1e-5, atol=1e-5)


def test_greedy_tokens_through_the_blocks_equal_the_float_paths(
    blocks_smollm2: Model, float_smollm2: Model
) -> None:
    if blocks_smollm2.weights.lm_head_blocks is None:
        pytest.skip("the CPU block kernels are not built")
    ids = context_ids(float_smollm2, 64, default_text())
    runs = []
    for model in (float_smollm2, blocks_smollm2):
        ffn, engine = DenseFfn(model), parse_engine("standard").build(model)
        tokens = []
        with torch.inference_mode():
            token = int(next_token_logits(model, engine.prefill(model, ffn, ids)).argmax())
            for _ in range(40):
                tokens.append(token)
                token = int(
                    next_token_logits(model, engine.decode_step(model, ffn, token)).argmax()
                )
        runs.append(tokens)
    assert runs[0] == runs[1]


def test_an_unknown_weights_mode_is_refused() -> None:
    with pytest.raises(ModelError, match="accepted: auto, float"):
        load_model(weights="q2")


def test_float_weights_keep_no_blocks(float_smollm2: Model) -> None:
    weights = float_smollm2.weights
    assert weights.lm_head_blocks is None and not weights.layers[0].blocks
    assert weights.block_bytes == 0
