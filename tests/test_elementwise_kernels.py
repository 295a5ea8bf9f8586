"""The one-launch RoPE, SiLU · up and 16-bit RMS norm (compiled on CUDA, in Triton's
interpreter on a CPU machine) give what torch's ops give, on the layouts the layer hands them:
q and k as strided views of one projection, partial rotary widths, head sizes that are not a
power of two, gate and up as the two halves of one product, norms over heads (q/k norms) and
rows of odd widths, a decode step's K and V rows written where the device-held position says."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import kernel_module
from larql.inference.rope import RopeTable, apply_rope
from larql.kernels import elementwise_kernels
from larql.models.rope import RopeSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rope_rows(rotary_dim: int, positions: list[int], dtype: torch.dtype):
    spec = RopeSpec(base=10000.0, rotary_dim=rotary_dim)
    table = RopeTable(spec, dtype, torch.device(DEVICE))
    return table.rows(positions)


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    """On CUDA torch's own tolerances. Triton's interpreter truncates where the device rounds
    float32 → bfloat16 to nearest, so there a bfloat16 result may be an ulp or two off (of
    values up to ~4 here: ≤ 2 · 2⁻⁶)."""
    if torch.cuda.is_available() or dtype != torch.bfloat16:
        return {}
    return {"rtol": 2**-6, "atol": 2**-5}


def _torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope`'s torch ops (on CUDA `apply_rope` itself takes the kernel)."""
    if x.is_cuda:
        return apply_rope(x.cpu(), cos.cpu(), sin.cpu()).to(x.device)
    return apply_rope(x, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("dim", "rotary_dim"), [(64, 64), (64, 32), (80, 80)])
def test_rope_in_one_launch_equals_torchs(dtype, dim, rotary_dim) -> None:
    elementwise = kernel_module("larql.kernels.elementwise")
    heads, kv_heads, rows = 6, 2, 3
    generator = torch.Generator().manual_seed(dim + rotary_dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    qkv = qkv.to(DEVICE)
    # q and k as the layer reads them: a strided view of the projection, heads first
    qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim).transpose(0, 1)
    cos, sin = _rope_rows(rotary_dim, [0, 7, 4097], dtype)
    got = elementwise.rope(qk, cos, sin)  # [H, S, D]
    expected = _torch_rope(qk, cos, sin)
    assert got.shape == expected.shape == (heads + kv_heads, rows, dim)
    torch.testing.assert_close(got, expected, **_tolerance(dtype))
    # the rotation did something, and the dims past the rotary width passed through
    assert not torch.equal(got, qk)
    torch.testing.assert_close(got[..., rotary_dim:], qk[..., rotary_dim:], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1536, 1500])
def test_silu_times_up_in_one_launch_equals_torchs(dtype, width) -> None:
    elementwise = kernel_module("larql.kernels.elementwise")
    generator = torch.Generator().manual_seed(width)
    gate_up = (3 * torch.randn(4, 2 * width, generator=generator)).to(dtype).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)  # strided halves, as the MLP's product gives them
    got = elementwise.silu_mul(gate, up)
    expected = (F.silu(gate.cpu()) * up.cpu()).to(DEVICE)
    assert got.shape == (4, width)
    torch.testing.assert_close(got, expected, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 576), (4, 2, 64), (2, 1000)])
def test_rms_norm_in_one_launch_equals_torchs(dtype, shape) -> None:
    elementwise = kernel_module("larql.kernels.elementwise")
    generator = torch.Generator().manual_seed(shape[-1])
    x = (2 * torch.randn(*shape, generator=generator)).to(dtype).to(DEVICE)
    weight = (1 + torch.randn(shape[-1], generator=generator)).to(dtype).to(DEVICE)
    got = elementwise.rms_norm(x, weight, 1e-5)
    expected = F.rms_norm(x.cpu().float(), (shape[-1],), None, 1e-5).to(dtype) * weight.cpu()
    assert got.shape == x.shape
    torch.testing.assert_close(got, expected.to(DEVICE), **_tolerance(dtype))


@pytest.mark.parametrize("dim", [64, 80])
def test_store_row_writes_k_and_v_at_the_position_and_nothing_else(dim) -> None:
    elementwise = kernel_module("larql.kernels.elementwise")
    kv_heads, capacity, heads = 3, 16, 6
    generator = torch.Generator().manual_seed(dim)
    keys = torch.randn(kv_heads, capacity, dim, generator=generator).bfloat16().to(DEVICE)
    values = torch.randn(kv_heads, capacity, dim, generator=generator).bfloat16().to(DEVICE)
    qkv = torch.randn(1, (heads + 2 * kv_heads) * dim, generator=generator).bfloat16().to(DEVICE)
    # k and v as the layer hands them: strided views of the projection, heads first
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(1, kv_heads, dim).transpose(0, 1)
    v = qkv[:, (heads + kv_heads) * dim :].view(1, kv_heads, dim).transpose(0, 1)
    pos = torch.tensor([11], device=DEVICE)
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_keys.index_copy_(1, pos, k)
    expected_values.index_copy_(1, pos, v)
    elementwise.store_row(keys, values, k, v, pos)
    assert torch.equal(keys, expected_keys)
    assert torch.equal(values, expected_values)


def test_the_one_launch_forms_run_only_on_cuda() -> None:
    x = torch.zeros(2, 3)
    assert elementwise_kernels(x) is None  # a CPU tensor keeps torch's ops
    if torch.cuda.is_available():
        assert elementwise_kernels(x.cuda()) is not None
        # float64, the precision reference, keeps torch's ops (the kernels compute in float32)
        assert elementwise_kernels(x.cuda().double()) is None


def test_dependent_launches_only_where_their_ptx_runs(monkeypatch: pytest.MonkeyPatch):
    """The decode step's kernels wait on the previous launch with `griddepcontrol`, PTX of
    compute capability 9.0 and later: never on a CPU tensor or under Triton's interpreter (which
    runs no PTX, and these tests' CPU runs use it), always on such a device."""
    dependent_launch = kernel_module("larql.kernels.dependent_launch")
    off = {"PDL": False, "launch_pdl": False}
    assert dependent_launch.options(torch.device("cpu")) == off
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        capable = torch.cuda.get_device_capability() >= (9, 0)
        assert dependent_launch.options(cuda) == {"PDL": capable, "launch_pdl": capable}
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dependent_launch.options(torch.device("cuda")) == off
