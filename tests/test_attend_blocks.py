"""A masked prompt whose scores would be large attends in blocks of queries
(`layer.MASKED_SCORES_LIMIT`), each over the keys it can reach: the same output as one masked
product, for a window, keys before the queries (a prompt's later part) and an engine's
`allowed` rows, soft-capped scores (tiny Gemma 2) included."""

from __future__ import annotations

import pytest
import torch

from larql.inference import layer as layer_module
from larql.inference.layer import attend
from larql.models import Model


@pytest.mark.parametrize("softcapped", [False, True])
@pytest.mark.parametrize(
    "case",
    ["window", "keys before the queries", "allowed", "window and allowed"],
)
def test_blocks_of_queries_attend_as_one_product(
    case: str, softcapped: bool, smollm2: Model, tiny_gemma2: Model, monkeypatch
) -> None:
    model = tiny_gemma2 if softcapped else smollm2
    cfg = model.config
    layer = next(i for i, spec in enumerate(cfg.layers) if spec.sliding_window is None)
    generator = torch.Generator().manual_seed(len(case))
    before = 0 if case == "window" else 20  # keys of earlier positions
    s = 37
    t = before + s

    def draw(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator)

    q = draw(cfg.num_heads, s, cfg.head_dim)
    keys, values = draw(cfg.num_kv_heads, t, cfg.head_dim), draw(cfg.num_kv_heads, t, cfg.head_dim)
    window = 6 if "window" in case else None
    allowed = None
    if "allowed" in case:
        allowed = torch.rand(s, t, generator=generator) < 0.7
        allowed[torch.arange(s), before + torch.arange(s)] = True  # each query sees itself
    whole = attend(model, layer, q, keys, values, before, window, allowed)  # [S, q_dim]
    calls = []
    blocked = layer_module._attend_in_blocks

    def counted(*args, **kwargs):
        calls.append(1)
        return blocked(*args, **kwargs)

    monkeypatch.setattr(layer_module, "_attend_in_blocks", counted)
    monkeypatch.setattr(layer_module, "MASKED_SCORES_LIMIT", cfg.num_heads * t * 5)
    in_blocks = attend(model, layer, q, keys, values, before, window, allowed)
    assert calls == [1]  # blocks of 5 queries
    torch.testing.assert_close(in_blocks, whole, rtol=1e-5, atol=1e-6)
