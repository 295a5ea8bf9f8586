"""The CPU kernels' one-query attention against torch's SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from larql.kernels.cpu.build import load as load_cpu_kernels

SHAPES = [(9, 3, 1, 64), (9, 3, 300, 64), (4, 1, 77, 256), (8, 8, 5, 40)]  # Hq, Hkv, T, D


@pytest.mark.parametrize(("heads", "kv_heads", "rows", "dim"), SHAPES)
def test_one_query_attention_is_sdpa(heads: int, kv_heads: int, rows: int, dim: int) -> None:
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels are not built")
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(heads, 1, dim, generator=g)
    cache = torch.randn(2, kv_heads, rows + 16, dim, generator=g)
    keys, values = cache[0, :, :rows], cache[1, :, :rows]  # strided views of a larger cache
    want = F.scaled_dot_product_attention(
        q[None], keys[None], values[None], scale=dim**-0.5, enable_gqa=heads != kv_heads
    )[0]
    got = kernels.one_query_attention(q.view(heads, dim), keys, values, dim**-0.5)
    assert torch.allclose(got, want.view(heads, dim), rtol=1e-5, atol=1e-6)


def test_one_query_attention_refuses_bad_shapes() -> None:
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels are not built")
    with pytest.raises(RuntimeError, match="shapes do not match"):
        kernels.one_query_attention(torch.randn(9, 64), torch.randn(2, 5, 64),
                                    torch.randn(2, 5, 64), 0.125)  # fmt: skip
