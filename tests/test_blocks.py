"""GGUF block weights on the CPU: the pure-torch layouts against the `gguf` package, the compiled
block product against the float product, and the default model's greedy tokens through both."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

import larql.inference.ffn.backend as ffn_backend_module
import larql.inference.fused_layer as fused_layer_module
import larql.inference.layer as layer_module
import larql.inference.linear as linear_module
import larql.kv.standard.engine as standard_engine_module
from helpers import relative_error, torch_threads
from larql.data import default_text
from larql.harness.contexts import context_ids
from larql.inference.ffn import DenseFfn
from larql.inference.ffn.policy import build_ffn
from larql.inference.generation import next_token_logits
from larql.inference.linear import (
    BLOCK_ROWS,
    TILED_BLOCK_ROWS,
    block_rows,
    linear,
    model_block_rows,
    reads_blocks,
)
from larql.inference.rope import apply_rope
from larql.kernels.cpu import cpu_extension
from larql.kernels.cpu.build import remove_other_builds
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
    """Block weights with a float32 input: the float path's products up to their sums' order."""
    return load_model("smollm2-135m", weights="blocks-float")


@pytest.fixture(scope="module")
def auto_smollm2() -> Model:
    """The default: block weights with the input rounded to int16 codes per block of 32."""
    return load_model("smollm2-135m", weights="auto")


def test_the_default_models_blocks_are_its_float_weights(
    blocks_smollm2: Model, float_smollm2: Model
) -> None:
    layer = blocks_smollm2.weights.layers[3]
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
    assert cpu_extension() is not None, "run `make setup` (python -m larql.kernels.cpu.build)"
    assert reads_blocks(blocks_smollm2) and not reads_blocks(float_smollm2)


def test_a_build_removes_the_builds_beside_it(tmp_path: Path) -> None:
    """`make setup` after a source change leaves one build, not one per change."""
    kept, old = tmp_path / "new-key", tmp_path / "old-key"
    for folder in (kept, old):
        folder.mkdir()
        (folder / "larql_block_gemv.so").write_bytes(b"built")
    stray = tmp_path / "notes.txt"
    stray.write_text("not a build")
    assert remove_other_builds(kept) == [old]
    assert (kept / "larql_block_gemv.so").exists() and not old.exists() and stray.exists()


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("width", [32, 576, 1536])
def test_block_product_is_the_float_product(qtype: GGMLQuantizationType, width: int) -> None:
    kernels = cpu_extension()
    if kernels is None:
        pytest.skip("the CPU block kernels are not built")
    rows = _random_rows(qtype, 200, width, width)
    x = torch.randn(width, generator=torch.Generator().manual_seed(1))
    got = kernels.block_gemv(x, rows.data, FORMAT_CODES[rows.format], 0)
    want = rows.dequantize().double() @ x.double()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _rounded(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x: [K] → x rounded per block of 32 to int8 / int16 codes times max|x| / (2^(bits−1) − 1),
    in float32 steps as the kernel takes them."""
    blocks = x.view(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / (2 ** (bits - 1) - 1)  # [K/32, 1]
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse) * d).reshape(-1)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("width", [32, 576, 1536])
@pytest.mark.parametrize("bits", [8, 16])
def test_integer_block_product_is_the_product_with_x_rounded(
    qtype: GGMLQuantizationType, width: int, bits: int
) -> None:
    kernels = _kernels_or_skip()
    rows = _random_rows(qtype, 200, width, width)
    x = torch.randn(width, generator=torch.Generator().manual_seed(1))
    if width > 32:
        x[:32] = 0  # an all-zero block: scale 0, codes 0
    got = kernels.block_gemv(x, rows.data, FORMAT_CODES[rows.format], bits).double()
    weights, rounded = rows.dequantize().double(), _rounded(x, bits).double()
    # every format's weights, Q4_1's offsets too, multiply the rounded x (its block sums too)
    want = weights @ rounded  # [200]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert not torch.allclose(want, weights @ x.double(), rtol=1e-9, atol=0)  # x was rounded
    # and it stays within the rounding's bound of the float product: |Δx_i| ≤ d_b / 2
    bound = weights.abs() @ (x.double() - rounded).abs()
    assert ((got - weights @ x.double()).abs() <= bound * 1.001 + 1e-4).all()


def test_linear_reads_the_blocks_and_falls_back_without_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows = _random_rows(GGMLQuantizationType.Q4_1, 64, 128, 2)
    generator = torch.Generator().manual_seed(5)
    weight, bias = rows.dequantize(), torch.randn(64, generator=generator)
    x = torch.randn(1, 128, generator=generator)
    want = F.linear(x, weight, bias)
    # float32 sums of 128 products in another order: ~1e-5 apart on outputs of ~10
    assert torch.allclose(linear(x, weight, bias, rows), want, rtol=1e-5, atol=1e-4)
    assert linear(x.bfloat16(), weight.bfloat16(), None, rows).dtype == torch.bfloat16
    monkeypatch.setattr(linear_module, "cpu_extension", lambda: None)
    assert torch.allclose(linear(x, weight, bias, rows), want, rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_greedy_tokens_through_the_blocks_equal_the_float_paths(
    blocks_smollm2: Model, auto_smollm2: Model, float_smollm2: Model
) -> None:
    if blocks_smollm2.weights.lm_head_blocks is None:
        pytest.skip("the CPU block kernels are not built")
    assert auto_smollm2.weights.layers[0].blocks["wo"].activation == "int16"
    ids = context_ids(float_smollm2, 64, default_text())
    runs = []
    for model in (float_smollm2, blocks_smollm2, auto_smollm2):
        ffn, engine = DenseFfn(model), parse_engine("standard").build(model)
        tokens = []
        with torch.inference_mode():
            token = int(next_token_logits(model, engine.prefill(model, ffn, ids)).argmax())
            for _ in range(16):
                tokens.append(token)
                token = int(
                    next_token_logits(model, engine.decode_step(model, ffn, token)).argmax()
                )
        runs.append(tokens)
    assert runs[0] == runs[1] == runs[2]


def test_an_unknown_weights_mode_is_refused() -> None:
    accepted = "accepted: auto, blocks-int16, blocks-int8, blocks-float, float, q8_0, q4_0"
    with pytest.raises(ModelError, match=accepted):
        load_model(weights="q2")


def test_float_weights_keep_no_blocks(float_smollm2: Model) -> None:
    weights = float_smollm2.weights
    assert weights.lm_head_blocks is None and not weights.layers[0].blocks
    assert weights.block_bytes == 0


def _kernels_or_skip():
    kernels = cpu_extension()
    if kernels is None:
        pytest.skip("the CPU block kernels are not built")
    return kernels


@pytest.mark.parametrize("rotary", [64, 32])
def test_fused_qkv_is_norm_product_and_rope(rotary: int) -> None:
    kernels = _kernels_or_skip()
    heads, kv_heads, dim, width = 4, 2, 64, 256
    rows = _random_rows(GGMLQuantizationType.Q4_1, (heads + 2 * kv_heads) * dim, width, 3)
    g = torch.Generator().manual_seed(4)
    h, norm = torch.randn(1, width, generator=g), torch.rand(width, generator=g) + 0.5
    bias = torch.randn(rows.out_features, generator=g)
    angles = torch.rand(rotary // 2, generator=g) * 6
    cos = torch.cat((angles.cos(), angles.cos()))
    sin = torch.cat((-angles.sin(), angles.sin()))
    got = kernels.decode_qkv(
        h, norm, 1e-5, rows.data, FORMAT_CODES["q4_1"], bias, cos, sin, heads + kv_heads, dim, 0
    )
    x = F.rms_norm(h.double(), (width,), norm.double(), 1e-5)
    qkv = (x @ rows.dequantize().double().T + bias.double()).view(-1, dim)  # [heads, D]
    rotated = qkv[: heads + kv_heads]
    want = qkv.clone()
    want[: heads + kv_heads] = apply_rope(
        rotated.unsqueeze(1), cos.double()[None], sin.double()[None]
    ).squeeze(1)
    assert torch.allclose(got.double(), want.reshape(-1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_fused_residual_products(qtype: GGMLQuantizationType) -> None:
    kernels = _kernels_or_skip()
    code = FORMAT_CODES[GGUF_FORMATS[qtype]]
    width, hidden = 128, 320
    g = torch.Generator().manual_seed(5)
    h, attn = torch.randn(1, width, generator=g), torch.randn(1, 96, generator=g)
    wo, bias = _random_rows(qtype, width, 96, 6), torch.randn(width, generator=g)
    want = h.double() + attn.double() @ wo.dequantize().double().T + bias.double()
    got = kernels.residual_gemv(h, attn, wo.data, code, bias, 0)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
    gate_up, down = _random_rows(qtype, 2 * hidden, width, 7), _random_rows(qtype, width, hidden, 8)
    norm = torch.rand(width, generator=g) + 0.5
    x = F.rms_norm(h.double(), (width,), norm.double(), 1e-6)
    gate, up = (x @ gate_up.dequantize().double().T).chunk(2, dim=-1)
    want = h.double() + (F.silu(gate) * up) @ down.dequantize().double().T
    got = kernels.residual_ffn(h, norm, 1e-6, gate_up.data, code, down.data, code, 0)
    # float32 sums over 320 products of values in the hundreds
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("bits", [8, 16])
def test_fused_pieces_with_integer_input_are_the_integer_products(
    qtype: GGMLQuantizationType, bits: int
) -> None:
    kernels = _kernels_or_skip()
    code = FORMAT_CODES[GGUF_FORMATS[qtype]]
    width, hidden, heads, dim = 128, 320, 3, 32

    def product(x: torch.Tensor, rows: BlockRows) -> torch.Tensor:  # [in] → [out]
        return kernels.block_gemv(x.contiguous(), rows.data, code, bits)

    g = torch.Generator().manual_seed(9)
    h, norm = torch.randn(1, width, generator=g), torch.rand(width, generator=g) + 0.5
    x = F.rms_norm(h, (width,), norm, 1e-5).reshape(-1)
    qkv_rows = _random_rows(qtype, heads * dim, width, 10)
    ones, zeros = torch.ones(dim), torch.zeros(dim)  # RoPE at angle 0: the identity
    got = kernels.decode_qkv(
        h, norm, 1e-5, qkv_rows.data, code, None, ones, zeros, heads, dim, bits
    )
    assert torch.allclose(got, product(x, qkv_rows), rtol=1e-4, atol=1e-4)
    wo = _random_rows(qtype, width, 96, 11)
    attn = torch.randn(1, 96, generator=g)
    got = kernels.residual_gemv(h, attn, wo.data, code, None, bits)
    assert torch.allclose(got, h + product(attn.reshape(-1), wo), rtol=1e-4, atol=1e-4)
    gate_up = _random_rows(qtype, 2 * hidden, width, 12)
    down = _random_rows(qtype, width, hidden, 13)
    gate, up = product(x, gate_up).chunk(2)
    want = h + product(F.silu(gate) * up, down)
    got = kernels.residual_ffn(h, norm, 1e-5, gate_up.data, code, down.data, code, bits)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "dim"),
    [
        (1, 9, 3, 64),
        (63, 9, 3, 64),  # groups of 3: all three in one pass (AVX-512), else a pair and one
        (130, 9, 3, 64),
        (700, 9, 3, 64),
        (700, 6, 1, 64),  # a group of 6: two passes of three (or three pairs)
        (130, 12, 3, 64),  # groups of 4: three and one (or two pairs)
        (130, 3, 3, 64),  # no grouping: one head a pass
        (130, 8, 2, 128),  # the 128-wide heads one at a time
        (130, 6, 2, 48),  # another width: the generic loops
    ],
)
def test_decode_attention_is_grouped_softmax_attention(
    rows: int, heads: int, kv_heads: int, dim: int
) -> None:
    kernels = _kernels_or_skip()
    g = torch.Generator().manual_seed(rows)
    # token-major storage with spare capacity, handed out as [Hkv, T, D] views (as KvBuffer does)
    keys = torch.randn(rows + 9, kv_heads, dim, generator=g)[:rows].transpose(0, 1)
    values = torch.randn(rows + 9, kv_heads, dim, generator=g)[:rows].transpose(0, 1)
    q = torch.randn(heads, 1, dim, generator=g) * 2
    scale = dim**-0.5
    want = F.scaled_dot_product_attention(
        q[None].double(), keys[None].double(), values[None].double(), scale=scale, enable_gqa=True
    )[0].reshape(1, -1)  # [1, Hq · D]: one query, heads in order
    got = kernels.decode_attention(q, keys, values, scale)
    assert got.shape == (1, heads * dim)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)


def test_an_unknown_activation_width_is_refused() -> None:
    kernels = _kernels_or_skip()
    rows = _random_rows(GGMLQuantizationType.Q4_1, 8, 64, 1)
    with pytest.raises(RuntimeError, match=r"activation_bits must be 0 \(float32 input\), 8"):
        kernels.block_gemv(torch.randn(64), rows.data, FORMAT_CODES["q4_1"], 4)


def test_decode_attention_refuses_mismatched_heads() -> None:
    kernels = _kernels_or_skip()
    keys = torch.randn(2, 5, 64)
    with pytest.raises(RuntimeError, match="multiple of K/V heads"):
        kernels.decode_attention(torch.randn(3, 1, 64), keys, keys, 0.125)


def test_fused_decode_step_matches_the_operator_path(
    blocks_smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    _kernels_or_skip()
    ids = context_ids(blocks_smollm2, 48, default_text())
    logits = []
    for fused in (True, False):
        if not fused:  # the torch operators, still over the blocks' products
            monkeypatch.setattr(layer_module, "takes_fused", lambda h, blocks=None: False)
            monkeypatch.setattr(layer_module, "takes_fused_attention", lambda q, k, v: False)
            monkeypatch.setattr(fused_layer_module, "takes_fused", lambda h, blocks=None: False)
            monkeypatch.setattr(ffn_backend_module, "takes_fused", lambda h, blocks=None: False)
        ffn, engine = DenseFfn(blocks_smollm2), parse_engine("standard").build(blocks_smollm2)
        with torch.inference_mode():
            engine.prefill(blocks_smollm2, ffn, ids)
            steps = [engine.decode_step(blocks_smollm2, ffn, t) for t in (42, 7, 1999)]
        logits.append(torch.stack([next_token_logits(blocks_smollm2, s) for s in steps]))
    assert torch.allclose(logits[0], logits[1], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    ("spec", "prompt", "weights"),
    [
        # a prompt longer than the compiled layer takes: prefilled by the operators both times
        ("standard", 0, "blocks-float"),
        ("standard", 0, "auto"),
        ("standard:window=24", 0, "blocks-float"),
        # long: the standard case checks the int16 inputs' long prompt, window=24 its window
        pytest.param("standard:window=24", 0, "auto", marks=pytest.mark.long),
        # a short prompt's rows (causal, windowed) through the compiled layer too; with int16
        # inputs its many rows' roundings differ from the operators' by a code here and there
        # (rms_norm's sums in another order), so the float inputs show the arithmetic alike
        ("standard:window=8", 14, "blocks-float"),
    ],
)
def test_the_compiled_decode_layer_is_the_layer_step(
    spec: str,
    prompt: int,
    weights: str,
    blocks_smollm2: Model,
    auto_smollm2: Model,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode rows, and a prompt of up to `model_block_rows` rows, through the compiled layer give
    the operators' logits."""
    _kernels_or_skip()
    model = blocks_smollm2 if weights == "blocks-float" else auto_smollm2
    ids = context_ids(model, prompt or model_block_rows(model) + 8, default_text())
    compiled_calls = []
    real_layers = fused_layer_module.fused_layers_rows

    def counted(*args: object) -> torch.Tensor | None:
        out = real_layers(*args)
        compiled_calls.append(out is not None)
        return out

    def refused(*args: object) -> None:  # layer_step's pieces instead
        return None

    logits = []
    for compiled in (True, False):
        monkeypatch.setattr(
            standard_engine_module, "fused_layers_rows", counted if compiled else refused
        )
        if not compiled:
            monkeypatch.setattr(standard_engine_module, "fused_layer_step", refused)
        ffn, engine = DenseFfn(model), parse_engine(spec).build(model)
        with torch.inference_mode():
            engine.prefill(model, ffn, ids)
            steps = [engine.decode_step(model, ffn, t) for t in (42, 7, 1999, 5, 300, 11)]
        logits.append(torch.stack([next_token_logits(model, s) for s in steps]))
    # every decode step (and a prompt of up to model_block_rows) ran all its layers in one call
    assert len(compiled_calls) == 6 + (len(ids) <= model_block_rows(model)) and all(compiled_calls)
    # float32 sums in another order over 30 layers: within 2e-5 of the logits' scale (a
    # prompt's rows through the compiled layer measured 8e-6 on one machine, 0 on another)
    assert relative_error(logits[0], logits[1]) <= 2e-5
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


def _random_q4_k(out: int, width: int, seed: int) -> np.ndarray:
    """GGUF Q4_K bytes of a random matrix [out, width]: random codes, scales and minimums, and
    positive f16 super-block scales d and dmin of a trained model's size."""
    rng = np.random.default_rng(seed)
    supers = rng.integers(0, 256, size=(out, width // 256, 144), dtype=np.uint8)
    for offset in (0, 2):  # d, then dmin
        halves = rng.uniform(1e-4, 2e-2, size=(out, width // 256)).astype(np.float16)
        supers[..., offset : offset + 2] = halves.view(np.uint8).reshape(out, -1, 2)
    return supers.reshape(out, -1)


@pytest.mark.parametrize("width", [256, 1536])
def test_q4_k_repacked_in_blocks_of_32_is_the_gguf_matrix(width: int) -> None:
    raw = _random_q4_k(40, width, width)
    rows = BlockRows.from_gguf(GGMLQuantizationType.Q4_K, raw, (40, width))
    assert rows.format == "q4_k32" and rows.data.shape == (40, width // 32 * 24)
    want = dequantize(raw, GGMLQuantizationType.Q4_K)  # the gguf package's own reading
    assert torch.equal(rows.dequantize(), torch.from_numpy(want))


@pytest.mark.parametrize("bits", [0, 8, 16])
def test_q4_k_block_products(bits: int) -> None:
    kernels = _kernels_or_skip()
    code = FORMAT_CODES["q4_k32"]
    width, hidden = 512, 768
    g = torch.Generator().manual_seed(bits)
    h, norm = torch.randn(1, width, generator=g), torch.rand(width, generator=g) + 0.5
    gate_up = BlockRows.from_gguf(
        GGMLQuantizationType.Q4_K, _random_q4_k(2 * hidden, width, 1), (2 * hidden, width)
    )
    down = BlockRows.from_gguf(
        GGMLQuantizationType.Q4_K, _random_q4_k(width, hidden, 2), (width, hidden)
    )
    x = F.rms_norm(h, (width,), norm, 1e-5).reshape(-1)
    product = kernels.block_gemv(x, gate_up.data, code, bits).double()
    if bits == 0:  # the float product with the dequantised weights
        want = gate_up.dequantize().double() @ x.double()
    else:  # the product with x rounded (the offsets times its rounded block sums too)
        want = gate_up.dequantize().double() @ _rounded(x, bits).double()
    assert torch.allclose(product, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    gate, up = kernels.block_gemv(x, gate_up.data, code, bits).chunk(2)
    want = h + kernels.block_gemv(F.silu(gate) * up, down.data, code, bits)
    got = kernels.residual_ffn(h, norm, 1e-5, gate_up.data, code, down.data, code, bits)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_the_commands_ffn_router_hands_on_the_compiled_mlp(auto_smollm2: Model) -> None:
    """`run` / `bench` / `serve` build their FFN as a per-layer router: it must offer its
    layers' compiled MLP and blocks as the dense backend itself does."""
    _kernels_or_skip()
    router, dense = build_ffn(auto_smollm2, "dense"), DenseFfn(auto_smollm2)
    assert router.silu_blocks(3) == dense.silu_blocks(3) and router.silu_blocks(3) is not None
    h = torch.randn(1, auto_smollm2.config.hidden_size)
    norm, eps = auto_smollm2.weights.layers[3].ffn_norm, auto_smollm2.config.norm_eps
    assert torch.equal(router.fused_block(3, h, norm, eps), dense.fused_block(3, h, norm, eps))


def test_prompts_take_the_blocks_only_where_their_products_beat_blas() -> None:
    """Up to 256 rows go through the block products where they are tiled (int16 or int8 inputs
    on a CPU with AVX-512 VNNI), up to 16 otherwise: the untiled ones, and float inputs, lose
    to BLAS on the float matrix past that."""
    kernels = cpu_extension()
    tiled = kernels is not None and kernels.tiled()
    assert block_rows("int16") == block_rows("int8") == (TILED_BLOCK_ROWS if tiled else BLOCK_ROWS)
    assert block_rows("float") == BLOCK_ROWS


@pytest.mark.parametrize(
    "qtype",
    [
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q4_K,
    ],
)
@pytest.mark.parametrize("outputs", [96, 112])  # 6 tiles of 16 rows (taken in pairs), 7
@pytest.mark.parametrize("bits", [16, 8])
def test_tiled_products(qtype: GGMLQuantizationType, outputs: int, bits: int) -> None:
    """On a CPU with AVX-512 VNNI (int16 products of more than 8 rows on AMX tiles where it has
    them, else with VNNI; int8 ones with VNNI): a block matrix tiled for them gives, for int16
    or int8 inputs, the untiled product's result up to the order of its float sums (the same
    codes), so the float product within the inputs' rounding; each row of a batch bit for bit
    its product alone (with AMX: the batch on the tiles, the row alone with VNNI); and it
    refuses float inputs by name — for an even count of 16-row tiles and an odd
    one (AMX then takes the last tile alone), and for batches of more than one pass of inputs."""
    kernels = cpu_extension()
    if kernels is None or not kernels.tiled():
        pytest.skip("needs the CPU kernels built with AVX-512 VNNI, on a CPU that has it")
    width = 256 if qtype == GGMLQuantizationType.Q4_K else 96
    if qtype == GGMLQuantizationType.Q4_K:
        raw = _random_q4_k(outputs, width, 5)
    else:
        weights = np.random.default_rng(3).standard_normal((outputs, width)).astype(np.float32)
        raw = quantize(weights, qtype)
    rows = BlockRows.from_gguf(qtype, raw, (outputs, width))
    code = FORMAT_CODES[rows.format]
    tiled = kernels.tile_rows(rows.data, code)
    assert tiled.shape == rows.data.shape and not torch.equal(tiled, rows.data)
    x = torch.randn(19, width, generator=torch.Generator().manual_seed(4))  # 16 + 3 inputs
    reference = x.double() @ rows.dequantize().double().T
    many = kernels.block_gemm(x, tiled, code + 16, bits)
    untiled = kernels.block_gemm(x, rows.data, code, bits)
    rounding = 1e-3 if bits == 16 else 3e-2  # int8 codes: a step of max|x_b| / 127
    assert (many.double() - reference).abs().max() < rounding * reference.abs().max()
    assert torch.allclose(many, untiled, rtol=1e-5, atol=1e-4)
    if bits == 8:  # the int8 codes, not the int16 ones
        wide = kernels.block_gemm(x, tiled, code + 16, 16)
        assert (many - wide).abs().max() > 1e-3 * reference.abs().max()
    for m in range(x.shape[0]):
        one = kernels.block_gemv(x[m].contiguous(), tiled, code + 16, bits)
        assert torch.equal(many[m], one), m
    with pytest.raises(ValueError, match="tiled blocks take int8 or int16 inputs"):
        kernels.block_gemm(x, tiled, code + 16, 0)


# A tiled product of 16 rows (on AMX tiles where the CPU has them), a bfloat16 matmul of
# torch's (oneDNN's AMX kernels there, which release the tiles after them), the product again.
_PRODUCT_AFTER_TORCH_AMX = """
import numpy as np, torch
from gguf import GGMLQuantizationType, quantize
from larql.kernels.cpu import cpu_extension
from larql.models.blocks import FORMAT_CODES, GGUF_FORMATS, BlockRows
kernels = cpu_extension()
q = GGMLQuantizationType.Q4_1
w = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
rows = BlockRows.from_numpy(GGUF_FORMATS[q], quantize(w, q), (64, 96))
code = FORMAT_CODES[rows.format]
tiled = kernels.tile_rows(rows.data, code)
x = torch.randn(16, 96, generator=torch.Generator().manual_seed(1))
before = kernels.block_gemm(x, tiled, code + 16, 16)
a = torch.randn(256, 256, dtype=torch.bfloat16)
(a @ a).float().sum().item()
after = kernels.block_gemm(x, tiled, code + 16, 16)
print(torch.equal(before, after))
"""


def test_tiled_products_run_after_torchs_own_amx_kernels() -> None:
    """torch's oneDNN kernels run on AMX tiles too and release them after their products; a
    tiled product on the same thread afterwards loads its tile configuration again (a tile
    instruction with none loaded is an illegal instruction: the process died with SIGILL). A
    fresh process, so that such a death fails this test, not the suite's worker."""
    kernels = cpu_extension()
    if kernels is None or not kernels.tiled():
        pytest.skip("needs the CPU kernels built with AVX-512 VNNI, on a CPU that has it")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _PRODUCT_AFTER_TORCH_AMX], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
@pytest.mark.parametrize("bits", [16, 8])
def test_the_tiled_mlp_gates_inside_its_product(qtype: GGMLQuantizationType, bits: int) -> None:
    """With tiled blocks the MLP's SiLU · up runs inside the gate/up product, a pair of tiles
    at a time: the result is the composition of the tiled products (torch's SiLU between them,
    within its rounding), and each row of a batch is its row alone, bit for bit — one row, a
    decode step's 8, a prompt's 40 — for int16 and int8 inputs, on one thread or two."""
    kernels = cpu_extension()
    if kernels is None or not kernels.tiled():
        pytest.skip("needs the CPU kernels built with AVX-512 VNNI, on a CPU that has it")
    code = FORMAT_CODES[GGUF_FORMATS[qtype]] + 16  # tiled
    width, hidden = 128, 320  # gate and up 20 tiles each
    gate_up = kernels.tile_rows(_random_rows(qtype, 2 * hidden, width, 12).data, code - 16)
    down = kernels.tile_rows(_random_rows(qtype, width, hidden, 13).data, code - 16)
    g = torch.Generator().manual_seed(9)
    h, norm = torch.randn(40, width, generator=g), torch.rand(width, generator=g) + 0.5
    x = F.rms_norm(h, (width,), norm, 1e-5)
    gate, up = kernels.block_gemm(x, gate_up, code, bits).chunk(2, dim=-1)
    want = h + kernels.block_gemm(F.silu(gate) * up, down, code, bits)
    got = kernels.residual_ffn(h, norm, 1e-5, gate_up, code, down, code, bits)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    for rows in (8, 1):
        batch = kernels.residual_ffn(h[:rows], norm, 1e-5, gate_up, code, down, code, bits)
        assert torch.equal(batch, got[:rows])
    for m in range(3):
        one = kernels.residual_ffn(h[m : m + 1], norm, 1e-5, gate_up, code, down, code, bits)
        assert torch.equal(one, got[m : m + 1])
    # over two threads (each makes and rounds its share of W_down's inputs): the same bits
    with torch_threads(2):
        for rows in (40, 8, 1):
            two = kernels.residual_ffn(h[:rows], norm, 1e-5, gate_up, code, down, code, bits)
            assert torch.equal(two, got[:rows]), rows
