"""The residual-stream engines' batched step (`kv/residual/engine`): on the default model as
`larql run` loads it, every layer of every session in one compiled call, each layer's input
row stored as its pre-layer residual; the same hidden rows as each session alone, and as the
layer-by-layer step. On float weights (no compiled layer) the sessions step in turn."""

from __future__ import annotations

import pytest
import torch

import larql.kv.residual.engine as residual_engine
from larql.data import default_text
from larql.harness.contexts import context_ids
from larql.inference.batching import batch_groups, decode_batch
from larql.inference.ffn import DenseFfn
from larql.inference.ffn.policy import build_ffn
from larql.inference.fused_layer import rows_kv
from larql.inference.layer import final_logits, recompute_kv
from larql.kv import parse_engine
from larql.models import Model

SPECS = ["markov-rs:window=16", "markov-rs-codec:window=16", "boundary-per-layer:window=16"]


def _greedy(engines, model: Model, ffn, prompts, steps: int, batched: bool) -> torch.Tensor:
    """Every session's hidden rows over `steps` greedy steps, [steps, B, H]."""
    tokens = [int(final_logits(model, e.prefill(model, ffn, p)[-1:]).argmax())
              for e, p in zip(engines, prompts, strict=True)]  # fmt: skip
    out = []
    for _ in range(steps):
        if batched:
            h = decode_batch(engines, model, ffn, tokens)
        else:
            h = torch.cat(
                [e.decode_step(model, ffn, t) for e, t in zip(engines, tokens, strict=True)]
            )
        tokens = [int(t) for t in final_logits(model, h).argmax(dim=-1)]
        out.append(h)
    return torch.stack(out)


@pytest.mark.parametrize("spec", SPECS)
def test_a_batch_is_each_session_alone(
    cpu_kernels, smollm2_default: Model, spec: str, monkeypatch
) -> None:
    """Sessions of 20, 40 and 70 tokens, 20 steps: the 16-row window overflows on the way (the
    codec engines' cold rows then re-derive their K/V)."""
    model, ffn = smollm2_default, build_ffn(smollm2_default)
    prompts = [context_ids(model, n, default_text()) for n in (20, 40, 70)]
    calls: list[int] = []
    real = residual_engine._fused_step

    def counted(batch, *args):
        out = real(batch, *args)
        calls.append(len(batch) if out is not None else 0)
        return out

    monkeypatch.setattr(residual_engine, "_fused_step", counted)
    together = [parse_engine(spec).build(model) for _ in prompts]
    got = _greedy(together, model, ffn, prompts, 20, batched=True)
    assert batch_groups(together) == [[0, 1, 2]]
    assert calls == [3] * 20  # one call a step for all three sessions
    alone = _greedy([parse_engine(spec).build(model) for _ in prompts], model, ffn, prompts, 20,
                    batched=False)  # fmt: skip
    assert torch.equal(got, alone)
    monkeypatch.setattr(residual_engine, "_fused_step", lambda *args: None)
    by_layer = _greedy([parse_engine(spec).build(model) for _ in prompts], model, ffn, prompts,
                       20, batched=True)  # fmt: skip
    assert torch.equal(got, by_layer)


def test_without_the_compiled_layer_the_sessions_step_in_turn(smollm2: Model) -> None:
    model, ffn = smollm2, DenseFfn(smollm2)
    prompts = [context_ids(model, n, default_text()) for n in (12, 30)]
    spec = "markov-rs:window=8"
    got = _greedy([parse_engine(spec).build(model) for _ in prompts], model, ffn, prompts, 6,
                  batched=True)  # fmt: skip
    alone = _greedy([parse_engine(spec).build(model) for _ in prompts], model, ffn, prompts, 6,
                    batched=False)  # fmt: skip
    assert torch.equal(got, alone)


def test_recompute_mode_steps_alone(smollm2_default: Model) -> None:
    engine = parse_engine("markov-rs:kv_cache=0").build(smollm2_default)
    engine.prefill(smollm2_default, build_ffn(smollm2_default), [1, 2, 3])
    assert engine.batch_key() is None


def test_a_lossy_rows_kv_is_the_float_recompute_within_rounding(
    cpu_kernels, smollm2_default: Model
) -> None:
    """The compiled re-derivation of evicted rows' K/V (block products of int16-rounded
    inputs) against `recompute_kv` over the float matrices, on the same stored rows: three
    rows of three layers, each row written to its own slot of its own storage."""
    model, ffn = smollm2_default, build_ffn(smollm2_default)
    engine = parse_engine("markov-rs-codec:window=8").build(model)
    engine.prefill(model, ffn, context_ids(model, 30, default_text()))
    store = engine.store
    layers = [0, 7, 29]
    stored = torch.stack([store.cold_rows(layer)[3:6] for layer in layers], dim=1)  # [3, 3, H]
    shape = store.kv[0]._k._data.shape
    storages = [[(torch.zeros(shape), torch.zeros(shape), 2 + 5 * row) for _ in layers]
                for row in range(3)]  # fmt: skip
    assert rows_kv(model, ffn, layers, stored, [3, 4, 5], storages)
    for j, layer in enumerate(layers):
        k, v = recompute_kv(model, layer, stored[:, j].contiguous(), 3)  # [Hkv, 3, D]
        for row in range(3):
            keys, values, slot = storages[row][j]
            torch.testing.assert_close(keys[slot], k[:, row], rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(values[slot], v[:, row], rtol=2e-3, atol=2e-3)
            assert not keys[:slot].any() and not keys[slot + 1 :].any()  # nothing else written


def test_rows_kv_refuses_stores_that_do_not_match_the_rows(cpu_kernels, smollm2_default) -> None:
    """A store list of the wrong length or a slot outside its storage is a typed refusal from
    the compiled call, nothing written."""
    model, ffn = smollm2_default, build_ffn(smollm2_default)
    rows = torch.randn(2, 1, model.config.hidden_size)
    shape = (4, model.config.num_kv_heads, model.config.head_dim)
    keys, values = torch.zeros(shape), torch.zeros(shape)
    with pytest.raises(RuntimeError, match="one entry per row and layer"):
        rows_kv(model, ffn, [0], rows, [0, 1], [[(keys, values, 0)]])
    with pytest.raises(RuntimeError, match="slot must lie in its storage"):
        rows_kv(model, ffn, [0], rows, [0, 1], [[(keys, values, 0)], [(keys, values, 4)]])
    assert not keys.any() and not values.any()


def test_rows_kv_of_a_decoded_row_is_the_k_v_its_step_wrote(cpu_kernels, smollm2_default) -> None:
    """The re-derivation is the decode step's own projection: the lossless hot rows of three
    decoded positions give back, bit for bit, the K/V their steps wrote (only W_qkv's K and V
    rows are multiplied; each output row is the same as in the whole product)."""
    model, ffn = smollm2_default, build_ffn(smollm2_default)
    engine = parse_engine("markov-rs:window=8").build(model)
    tokens = [int(final_logits(model, engine.prefill(model, ffn, [1, 2, 3, 4])).argmax())]
    for _ in range(3):
        tokens.append(int(final_logits(model, engine.decode_step(model, ffn, tokens[-1])).argmax()))
    store, layers = engine.store, list(range(model.config.num_layers))
    rows = store.hot.rows[-3:]  # [3, L, H]: the pre-layer residuals of positions 4..6
    shape = store.kv[0]._k._data.shape
    storages = [[(torch.zeros(shape), torch.zeros(shape), row) for _ in layers] for row in range(3)]
    assert rows_kv(model, ffn, layers, rows, [4, 5, 6], storages)
    for layer in layers:
        written = store.kv[layer]
        for row in range(3):
            keys, values, _ = storages[row][layer]
            assert torch.equal(keys[row], written.keys[:, 4 + row])
            assert torch.equal(values[row], written.values[:, 4 + row])
