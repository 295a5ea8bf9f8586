"""A decode row's products with their neighbours folded in (`larql.kernels.gemv`; compiled on
CUDA, in Triton's interpreter on a CPU machine) give what torch's operators give — the norm
before the QKV / gate-up / LM-head product, SiLU · up before the down product, the residual add
after the output and down products — on widths that are not a multiple of the blocks, with and
without a bias; and a layer's decode steps through them still match transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import larql.inference.ffn.backend as ffn_backend
import larql.inference.row_products as row_products
from helpers import kernel_module, teacher_forced
from larql.inference.ffn import DenseFfn
from larql.inference.generation import teacher_forced_logits
from larql.inference.layer import final_logits
from larql.inference.norm import rms_norm
from larql.inference.rope import RopeTable, apply_rope
from larql.kernels import gemv_kernels
from larql.kv.standard.engine import StandardEngine
from larql.models import load_model
from larql.models.rope import RopeSpec
from tiny_models import TinyModel, build_tiny_model, random_ids

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (N, K, the launch's (BN, BK, warps) or None for its own): rows and widths off the blocks, a
# column loop of several blocks
SHAPES = [(48, 64, None), (21, 100, None), (37, 576, (4, 64, 4)), (21, 100, (4, 64, 4))]


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Within a rounding of the result: the product's sum is ordered differently from torch's
    (and Triton's interpreter truncates where the device rounds float32 → bfloat16)."""
    if dtype == torch.bfloat16:
        return {"rtol": 2**-6, "atol": 2**-5}
    return {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture
def gemv_with(monkeypatch: pytest.MonkeyPatch):
    """The kernel module, launched with the given block shape (None: its own choice)."""
    gemv = kernel_module("larql.kernels.gemv")

    def launched_with(blocks: tuple[int, int, int] | None):
        if blocks is not None:
            monkeypatch.setattr(gemv, "_shape", lambda out_features, in_features: blocks)
        return gemv

    return launched_with


def _inputs(n: int, k: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        "weight": torch.randn(n, k, generator=generator) / k**0.5,
        "h": 2 * torch.randn(1, k, generator=generator),
        "norm": 1 + torch.randn(k, generator=generator) / 4,
        "bias": torch.randn(n, generator=generator),
        "residual": torch.randn(1, n, generator=generator),
        "gate_up": 2 * torch.randn(1, 2 * k, generator=generator),
    }
    return {name: t.to(dtype).to(DEVICE) for name, t in tensors.items()}


def _torch_norm(h: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """torch's 16-bit norm: statistics in float32, the normalised row rounded, then × weight."""
    h = h.cpu()
    return F.rms_norm(h.float(), (h.shape[-1],), None, 1e-5).to(h.dtype) * norm.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "blocks"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_normed_product_equals_norm_then_linear(gemv_with, dtype, n, k, blocks, with_bias) -> None:
    gemv = gemv_with(blocks)
    t = _inputs(n, k, dtype, seed=n + k)
    bias = t["bias"] if with_bias else None
    got = gemv.normed_gemv(t["h"], t["norm"], 1e-5, t["weight"], bias)
    cpu_bias = bias.cpu() if bias is not None else None
    expected = F.linear(_torch_norm(t["h"], t["norm"]), t["weight"].cpu(), cpu_bias)
    assert got.shape == (1, n) and got.dtype == dtype
    torch.testing.assert_close(got.cpu(), expected, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "blocks"), SHAPES)
def test_residual_product_equals_linear_then_add(gemv_with, dtype, n, k, blocks) -> None:
    gemv = gemv_with(blocks)
    t = _inputs(n, k, dtype, seed=2 * n + k)
    got = gemv.residual_gemv(t["residual"], t["h"], t["weight"], t["bias"])
    product = F.linear(t["h"].cpu(), t["weight"].cpu(), t["bias"].cpu())  # rounded, then added
    expected = t["residual"].cpu() + product
    torch.testing.assert_close(got.cpu(), expected, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "blocks"), SHAPES)
def test_gated_product_equals_silu_times_up_then_linear_then_add(
    gemv_with, dtype, n, k, blocks
) -> None:
    gemv = gemv_with(blocks)
    t = _inputs(n, k, dtype, seed=3 * n + k)
    got = gemv.gated_residual_gemv(t["residual"], t["gate_up"], t["weight"])
    gate, up = t["gate_up"].cpu().chunk(2, dim=-1)
    expected = t["residual"].cpu() + F.linear(F.silu(gate) * up, t["weight"].cpu())
    torch.testing.assert_close(got.cpu(), expected, **_tolerance(dtype))
    # the activation is really applied: the plain product of gate · up differs
    plain = t["residual"].cpu() + F.linear(gate * up, t["weight"].cpu())
    assert not torch.allclose(got.cpu(), plain, **_tolerance(dtype))


def _rope_inputs(heads: int, dim: int, position: int, dtype: torch.dtype):
    table = RopeTable(RopeSpec(base=10000.0, rotary_dim=dim), dtype, torch.device(DEVICE))
    return table.slice(position, 1)  # cos, sin: [1, dim]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "blocks"), [(64, None), (100, None), (576, (4, 64, 4))])
@pytest.mark.parametrize("with_bias", [False, True])
def test_normed_product_with_rope_equals_norm_linear_then_rope(
    gemv_with, dtype, k, blocks, with_bias
) -> None:
    """Five heads of 16 (three rotated, as q and k; two not, as v), a position far enough that
    every pair turns."""
    gemv = gemv_with(blocks)
    heads, dim, rotated = 5, 16, 3
    t = _inputs(heads * dim, k, dtype, seed=k)
    bias = t["bias"] if with_bias else None
    cos, sin = _rope_inputs(heads, dim, position=37, dtype=dtype)
    assert gemv.rope_fits(dim, dim, heads * dim)
    got = gemv.normed_gemv_rope(t["h"], t["norm"], 1e-5, t["weight"], bias, cos, sin, rotated, dim)
    cpu_bias = bias.cpu() if bias is not None else None
    product = F.linear(_torch_norm(t["h"], t["norm"]), t["weight"].cpu(), cpu_bias)  # [1, N]
    heads_first = product.view(heads, 1, dim)  # [heads, S, D], as the layer rotates them
    expected = torch.cat(
        (apply_rope(heads_first[:rotated], cos.cpu(), sin.cpu()), heads_first[rotated:])
    )
    assert got.shape == (1, heads * dim) and got.dtype == dtype
    torch.testing.assert_close(got.cpu().view(heads, 1, dim), expected, **_tolerance(dtype))
    # the rotation is really applied to the first heads only
    assert not torch.allclose(
        got.cpu()[:, : rotated * dim], product[:, : rotated * dim], **_tolerance(dtype)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_with_rope_stores_k_and_v_at_the_position(gemv_with, dtype) -> None:
    """Two q heads, two K heads (rotated) and two V heads of 16: with the cache given, the
    result is the same and its K and V heads are also the caches' row at the position,
    nothing else of the caches written."""
    gemv = gemv_with((4, 64, 4))
    q_heads, kv_heads, dim, capacity, position = 2, 2, 16, 7, 3
    heads = q_heads + 2 * kv_heads
    t = _inputs(heads * dim, 100, dtype, seed=3)
    cos, sin = _rope_inputs(heads, dim, position=position, dtype=dtype)
    rotated = q_heads + kv_heads
    alone = gemv.normed_gemv_rope(
        t["h"], t["norm"], 1e-5, t["weight"], None, cos, sin, rotated, dim
    )
    keys, values = (
        torch.full((kv_heads, capacity, dim), -7.0, dtype=dtype, device=DEVICE) for _ in range(2)
    )
    pos = torch.tensor([position], device=DEVICE)
    got = gemv.normed_gemv_rope(
        t["h"], t["norm"], 1e-5, t["weight"], None, cos, sin, rotated, dim, (keys, values, pos)
    )
    torch.testing.assert_close(got, alone, rtol=0, atol=0)
    k, v = alone.view(heads, dim)[q_heads:rotated], alone.view(heads, dim)[rotated:]
    assert torch.equal(keys[:, position], k) and torch.equal(values[:, position], v)
    others = [row for row in range(capacity) if row != position]
    assert bool((keys[:, others] == -7).all()) and bool((values[:, others] == -7).all())


def test_rope_is_folded_only_where_a_program_holds_whole_pairs(gemv_with) -> None:
    gemv = gemv_with(None)
    assert gemv.rope_fits(64, 64, 3072)
    assert not gemv.rope_fits(64, 32, 3072)  # partial rotary: the separate RoPE launch
    assert not gemv.rope_fits(6, 6, 36)  # a program's rows do not divide a head
    assert not gemv.rope_fits(64, 64, 3000)  # not whole heads


def test_the_folded_products_run_only_on_one_cuda_row() -> None:
    weight, row = torch.zeros(4, 3), torch.zeros(1, 3)
    assert gemv_kernels(row, weight) is None  # a CPU row keeps torch's operators
    if torch.cuda.is_available():
        weight, row = weight.cuda(), row.cuda()
        assert gemv_kernels(row, weight) is not None
        assert gemv_kernels(torch.zeros(2, 3, device="cuda"), weight) is None  # a prompt
        assert gemv_kernels(row.double(), weight.double()) is None  # the precision reference
        assert gemv_kernels(row, torch.zeros(3, 4, device="cuda").t()) is None  # strided


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    pytest.importorskip("transformers")
    return build_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"))


def test_decode_steps_through_the_folded_products_match_transformers(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny Qwen2 (a QKV bias, the LM head tied to the embedding), float32: every decode
    step's products go through the kernels (on a CPU machine, let run there in Triton's
    interpreter) and the logits stay transformers', the static cache's too."""
    gemv = kernel_module("larql.kernels.gemv")
    calls: dict[str, int] = {}

    def counted(name: str):
        launch = getattr(gemv, name)

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            if name == "normed_gemv_rope" and len(args) == 10 and args[9] is not None:
                calls["stores K/V"] = calls.get("stores K/V", 0) + 1  # (its `cache`)
            return launch(*args, **kwargs)

        return wrapper

    class Counted:
        normed_gemv = counted("normed_gemv")
        residual_gemv = counted("residual_gemv")
        gated_residual_gemv = counted("gated_residual_gemv")
        normed_gemv_rope = counted("normed_gemv_rope")
        rope_fits = staticmethod(gemv.rope_fits)

    def kernels_for(x: torch.Tensor, weight: torch.Tensor):
        one_row = x.dim() == 2 and x.shape[0] == 1 and weight.is_contiguous()
        return Counted if one_row else None

    monkeypatch.setattr(row_products, "gemv_kernels", kernels_for)
    monkeypatch.setattr(ffn_backend, "gemv_kernels", kernels_for)
    ids, prompt = random_ids(12, seed=5), 8
    theirs = tiny.hf_logits(ids)
    model = load_model(str(tiny.directory), dtype=torch.float32, device=DEVICE)
    ours = teacher_forced(model, "standard", ids, prompt).cpu()
    layers = model.config.num_layers
    # per decode step and layer: QKV with RoPE, gate/up, output, down (the LM head takes the
    # logged rows together here); on CUDA the step is captured once in a graph and replayed
    steps = len(ids) - prompt if DEVICE == "cpu" else 1
    assert calls["normed_gemv_rope"] >= steps * layers
    assert calls["normed_gemv"] >= steps * layers
    assert calls["residual_gemv"] >= steps * layers
    assert calls["gated_residual_gemv"] >= steps * layers
    assert (ours - theirs[prompt - 1 :]).abs().max().item() < 1e-4 * theirs.abs().max().item()
    # a decode step's own logits: the final norm folded into the LM head's product
    row, before = torch.randn(1, model.config.hidden_size, device=DEVICE), calls["normed_gemv"]
    logits = final_logits(model, row)
    expected = F.linear(
        rms_norm(row, model.weights.final_norm, model.config.norm_eps), model.weights.lm_head
    )
    assert calls["normed_gemv"] == before + 1
    # `standard`'s static cache (its CUDA graph path; eager on a CPU machine): each decode
    # row's K/V written by the QKV product's own launch, no store of its own
    engine = StandardEngine(static=True)
    static = teacher_forced_logits(engine, model, DenseFfn(model), ids, prompt).cpu()
    assert engine.dispatch_path() in ("static", "cuda-graph")
    assert calls.get("stores K/V", 0) >= steps * layers
    assert (static - theirs[prompt - 1 :]).abs().max().item() < 1e-4 * theirs.abs().max().item()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
