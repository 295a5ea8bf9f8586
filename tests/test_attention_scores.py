"""The attention weights the eviction scorers read (`larql.kv.eviction.scores`) against a
brute-force float64 softmax, query head by query head: their sum (`attention_mass`), and the
attention output and peak weight kvzip's reconstruction takes from one product
(`attended_with_peak`), whose output is the layer's own (`layer.attend`). Queries in chunks,
keys after the queries, a soft-cap and grouped query heads included."""

from __future__ import annotations

import pytest
import torch

from larql.inference.layer import attend
from larql.kv.eviction import scores
from larql.kv.eviction.scores import attended_with_peak, attention_mass
from larql.models import Model


def brute_weights(model: Model, q: torch.Tensor, keys: torch.Tensor, first: int) -> torch.Tensor:
    """q [Hq, S, D] at key rows first.. of keys [Hkv, T, D] → float64 weights [Hq, S, T]."""
    cfg = model.config
    group = q.shape[0] // keys.shape[0]
    k = keys.double().repeat_interleave(group, dim=0)  # [Hq, T, D]
    logits = q.double() @ k.transpose(1, 2) * cfg.attn_scale  # [Hq, S, T]
    if cfg.arch.attn_softcap is not None:
        logits = cfg.arch.attn_softcap * torch.tanh(logits / cfg.arch.attn_softcap)
    rows = first + torch.arange(q.shape[1])
    future = torch.arange(keys.shape[1])[None, :] > rows[:, None]  # [S, T]
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)


@pytest.mark.parametrize("softcapped", [False, True])
def test_weights_match_a_float64_softmax(
    softcapped: bool, smollm2: Model, tiny_gemma2: Model, monkeypatch
) -> None:
    model = tiny_gemma2 if softcapped else smollm2
    cfg = model.config
    assert (cfg.arch.attn_softcap is not None) == softcapped
    assert cfg.num_heads > cfg.num_kv_heads  # grouped query heads
    monkeypatch.setattr(scores, "_QUERY_CHUNK", 5)  # 13 queries: chunks of 5, 5 and 3
    torch.manual_seed(0)
    first, s = 20, 13
    t = first + s
    q = torch.randn(cfg.num_heads, s, cfg.head_dim)
    keys = torch.randn(cfg.num_kv_heads, t, cfg.head_dim)
    values = torch.randn(cfg.num_kv_heads, t, cfg.head_dim)
    weights = brute_weights(model, q, keys, first)  # [Hq, S, T]
    grouped = weights.view(cfg.num_kv_heads, -1, s, t)  # [Hkv, G, S, T]
    mass = attention_mass(model, q, keys, first)
    torch.testing.assert_close(mass.double(), grouped.sum(dim=(1, 2)), rtol=1e-5, atol=1e-6)
    out, peak = attended_with_peak(model, q, keys, values, first, rows=first + 4)
    expected_peak = grouped.amax(dim=(1, 2))[:, : first + 4]
    torch.testing.assert_close(peak.double(), expected_peak, rtol=1e-5, atol=1e-7)
    expected_out = torch.einsum(
        "hst,htd->shd", weights, values.double().repeat_interleave(q.shape[0] // keys.shape[0], 0)
    ).reshape(s, -1)
    torch.testing.assert_close(out.double(), expected_out, rtol=1e-4, atol=1e-5)
    full = next(i for i, layer in enumerate(cfg.layers) if layer.sliding_window is None)
    layer_out = attend(model, full, q, keys, values, first, None)  # [S, q_dim]
    torch.testing.assert_close(out, layer_out, rtol=1e-4, atol=1e-5)


def test_keys_after_the_queries_are_unseen(smollm2: Model) -> None:
    """Rows after a chunk's last query get no weight (only the chunk's tail is masked)."""
    cfg = smollm2.config
    torch.manual_seed(1)
    first, s, t = 8, 6, 30
    q = torch.randn(cfg.num_heads, s, cfg.head_dim)
    keys = torch.randn(cfg.num_kv_heads, t, cfg.head_dim)
    mass = attention_mass(smollm2, q, keys, first)
    grouped = brute_weights(smollm2, q, keys, first).view(cfg.num_kv_heads, -1, s, t)
    torch.testing.assert_close(mass.double(), grouped.sum(dim=(1, 2)), rtol=1e-5, atol=1e-6)
    assert not mass[:, first + s :].any()
