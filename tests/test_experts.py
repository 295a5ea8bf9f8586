"""Mixture-of-experts layers: routing, the two ways of running the experts, and the tiny MoE
models end to end (the logits against transformers are in test_hf_oracle.py, every engine over
them in test_engine_compliance.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from helpers import full_forward_logits, teacher_forced
from larql.cli.app import app
from larql.inference.ffn import build_ffn
from larql.inference.ffn.experts import (
    _gathered,
    _per_expert,
    expert_glu,
    experts_forward,
    route,
)
from larql.models import load_model
from larql.models.config import ExpertRouting
from larql.models.errors import ModelFormatError, UnsupportedArchitecture
from larql.models.mxfp4 import E2M1, dequantize_mxfp4
from tiny_models import build_tiny_model, random_ids, rewrite_config

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen2-moe")
    build_tiny_model("qwen2_moe", directory)
    return directory


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("mixtral")
    build_tiny_model("mixtral", directory)
    return directory


def test_route_picks_the_largest_probabilities_and_normalises_when_asked() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.5, 0.2]])
    plain, chosen = route(logits, ExpertRouting(4, 2, normalize_top_k=False))
    assert chosen.tolist() == [[1, 3], [0, 2]]
    torch.testing.assert_close(plain, torch.softmax(logits, -1).gather(1, chosen))
    normalised, again = route(logits, ExpertRouting(4, 2, normalize_top_k=True))
    assert torch.equal(again, chosen)
    torch.testing.assert_close(normalised.sum(-1), torch.ones(2))
    assert (plain.sum(-1) < 1).all()


def test_routing_rejects_more_experts_per_token_than_experts() -> None:
    with pytest.raises(ValueError, match="top_k 5"):
        ExpertRouting(4, 5, normalize_top_k=True)


def test_gathered_and_per_expert_runs_agree(qwen2_moe_dir: Path) -> None:
    """A decode step gathers each pair's expert, a prefill runs each expert over its tokens:
    the same arithmetic (float64, every layer of experts, several tokens)."""
    model = load_model(str(qwen2_moe_dir), dtype=torch.float64)
    routing = model.config.experts
    assert routing is not None
    x = torch.randn(6, model.config.hidden_size, dtype=torch.float64)
    glu = expert_glu(model.config)
    for lw in model.weights.layers:
        if lw.experts is None:
            continue
        weights, chosen = route(torch.nn.functional.linear(x, lw.experts.router), routing)
        assert chosen.unique().numel() > 1  # the tokens really go to different experts
        gathered = _gathered(lw.experts, x, weights.double(), chosen, glu)
        per_expert = _per_expert(lw.experts, x, weights.double(), chosen, glu)
        torch.testing.assert_close(gathered, per_expert, rtol=1e-12, atol=1e-12)


def test_hybrid_model_has_dense_and_expert_layers(qwen2_moe_dir: Path) -> None:
    model = load_model(str(qwen2_moe_dir))
    kinds = [(lw.w_gate_up is not None, lw.experts is not None) for lw in model.weights.layers]
    assert kinds[1] == (True, False)  # mlp_only_layers=[1]
    assert all(k == (False, True) for i, k in enumerate(kinds) if i != 1)
    experts = model.weights.layers[0].experts
    assert experts is not None and experts.shared_expert_gate is not None
    assert tuple(experts.gate_up.shape) == (4, 80, model.config.hidden_size)


def test_the_routing_normalisation_is_what_the_config_says(qwen2_moe_dir: Path) -> None:
    """norm_topk_prob=false here: renormalising the weights changes every logit."""
    model = load_model(str(qwen2_moe_dir))
    ids = random_ids(12)
    ours = full_forward_logits(model, ids)
    assert model.config.experts is not None and not model.config.experts.normalize_top_k
    renormalised = replace(model.config.experts, normalize_top_k=True)
    model.config = replace(model.config, experts=renormalised)
    assert (full_forward_logits(model, ids) - ours).abs().max().item() > 1e-3


def test_the_experts_alone_are_the_ffn_output(mixtral_dir: Path) -> None:
    model = load_model(str(mixtral_dir), dtype=torch.float64)
    lw = model.weights.layers[0]
    assert lw.experts is not None and lw.w_gate_up is None
    x = torch.randn(3, model.config.hidden_size, dtype=torch.float64)
    assert model.config.experts is not None
    direct = experts_forward(lw.experts, model.config.experts, x, expert_glu(model.config))
    torch.testing.assert_close(build_ffn(model, "dense").forward(0, x), direct)


def test_dtype_conversion_keeps_the_experts(qwen2_moe_dir: Path) -> None:
    model = load_model(str(qwen2_moe_dir))
    ids = random_ids(10)
    wide = model.to(dtype=torch.float64)
    torch.testing.assert_close(
        full_forward_logits(wide, ids).float(), full_forward_logits(model, ids), atol=1e-5, rtol=0
    )


def test_decode_matches_prefill_on_experts(mixtral_dir: Path) -> None:
    """Decode steps (gathered experts) give the logits of a whole-sequence pass (per expert)."""
    model = load_model(str(mixtral_dir), dtype=torch.float64)
    ids = random_ids(16)
    stepped = teacher_forced(model, "standard", ids, 4)
    whole = full_forward_logits(model, ids)[3:]
    assert (stepped - whole).abs().max().item() < 1e-10


def test_config_with_more_experts_per_token_than_experts_is_typed(
    mixtral_dir: Path, tmp_path: Path
) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(mixtral_dir, broken)
    rewrite_config(broken, num_experts_per_tok=9)
    with pytest.raises(ModelFormatError, match="top_k 9"):
        load_model(str(broken))


def test_run_and_walk_from_the_cli(mixtral_dir: Path) -> None:
    runner = CliRunner()
    run = runner.invoke(
        app,
        [
            "run",
            "w5 w6 w7",
            "-m",
            str(mixtral_dir),
            "-n",
            "4",
            "--output",
            "json",
            "--engine",
            "turbo-quant",
        ],
    )
    assert run.exit_code == 0, run.output
    assert len(json.loads(run.stdout.strip().splitlines()[-1])["tokens"]) == 4
    walk = runner.invoke(app, ["walk", "w5 w6 w7", "-m", str(mixtral_dir), "-k", "8"])
    assert walk.exit_code == 2
    assert "mixture of experts" in walk.output
    dense_walk = runner.invoke(app, ["walk", "w5 w6 w7", "-m", str(mixtral_dir)])
    assert dense_walk.exit_code == 0, dense_walk.output


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gpt-oss")
    build_tiny_model("gpt_oss", directory)
    return directory


@pytest.mark.parametrize("change", ["no sinks", "no clamp", "weights not renormalised"])
def test_every_gpt_oss_piece_is_load_bearing(gpt_oss_dir: Path, change: str) -> None:
    """The attention sinks, the clamped SwiGLU and the softmax over the top-k logits each
    change the logits (those with all three match transformers: test_hf_oracle.py)."""
    model = load_model(str(gpt_oss_dir))
    ids = random_ids(12)
    ours = full_forward_logits(model, ids)
    routing = model.config.experts
    assert routing is not None and routing.normalize_top_k
    if change == "no sinks":
        for lw in model.weights.layers:
            lw.attn_sinks = None
    elif change == "no clamp":
        assert routing.clamped_swiglu == (1.702, 0.5)
        model.config = replace(model.config, experts=replace(routing, clamped_swiglu=None))
    else:
        changed = replace(routing, normalize_top_k=False)
        model.config = replace(model.config, experts=changed)
    assert (full_forward_logits(model, ids) - ours).abs().max().item() > 1e-4


def test_gpt_oss_keeps_its_sinks_off_the_fast_paths(gpt_oss_dir: Path) -> None:
    """The compiled CPU layer and the decode-attention kernels have no sinks: decode steps
    take the eager path and still give the whole-sequence logits."""
    model = load_model(str(gpt_oss_dir), dtype=torch.float64)
    ids = random_ids(16)
    whole = full_forward_logits(model, ids)[3:]
    # turbo-quant keeps these 16 rows exact, at 16 bits
    for spec, tolerance in (("standard", 1e-9), ("markov-rs", 1e-9), ("turbo-quant", 2e-3)):
        stepped = teacher_forced(model, spec, ids, 4)
        assert (stepped - whole).abs().max().item() < tolerance, spec


def _mxfp4(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., R, C] (C a multiple of 32) → the nearest MXFP4: blocks uint8 [..., R, C/32,
    16] and scales uint8 [..., R, C/32] (a plain rounding; the checkpoint then holds exactly
    what these decode to)."""
    groups = weights.reshape(*weights.shape[:-1], -1, 32)
    largest = groups.abs().amax(-1).clamp_min(2.0**-60)
    exponent = torch.ceil(torch.log2(largest / 6.0))  # 6: E2M1's largest magnitude
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - torch.tensor(E2M1)).abs().argmin(-1)  # [..., G, 32]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def test_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path: Path) -> None:
    """GPT-OSS checkpoints ship their experts as MXFP4 blocks and scales: larql's dequantizer
    against transformers' on the same bytes, then the whole model's logits against
    transformers with those weights."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tiny = build_tiny_model("gpt_oss", tmp_path, hidden_size=64, intermediate_size=64)
    file = tmp_path / "model.safetensors"
    state = load_file(file)
    params = dict(tiny.hf_model.named_parameters())
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _mxfp4(state.pop(name).transpose(-1, -2))  # rows: output features
        oracle = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
        assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(-1, -2), oracle)
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        with torch.no_grad():
            params[name].copy_(oracle)
    save_file(state, file)
    rewrite_config(tmp_path, quantization_config={"quant_method": "mxfp4"})
    ids = random_ids(12)
    with torch.no_grad():
        expected = tiny.hf_model(torch.tensor([ids])).logits[0]
    ours = full_forward_logits(load_model(str(tmp_path)), ids)
    assert (ours - expected).abs().max().item() < 1e-4


def test_other_quantised_checkpoints_are_refused(tmp_path: Path) -> None:
    build_tiny_model("mixtral", tmp_path)
    rewrite_config(tmp_path, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(UnsupportedArchitecture, match="'gptq' are not supported"):
        load_model(str(tmp_path))
