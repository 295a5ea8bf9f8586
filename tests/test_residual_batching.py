"""The residual-stream engines' batched step (`kv/residual/engine`): on the default model as
`larql run` loads it, every layer of every session in one compiled call, each layer's input
row stored as its pre-layer residual; the same hidden rows as each session alone, and as the
layer-by-layer step. On float weights (no compiled layer) the sessions step in turn."""

from __future__ import annotations

import pytest
import torch

import larql.kv.residual.engine as residual_engine
from helpers import torch_threads
from larql.data import default_text
from larql.harness.contexts import context_ids
from larql.inference.batching import advance_batch, batch_groups, decode_batch
from larql.inference.errors import InvariantViolation
from larql.inference.ffn import DenseFfn
from larql.inference.ffn.policy import build_ffn
from larql.inference.fused_layer import rows_kv
from larql.inference.generation import GenerationSession, advance_together
from larql.inference.layer import final_logits, recompute_kv
from larql.inference.linear import model_block_rows
from larql.kv import parse_engine
from larql.models import Model

SPECS = ["markov-rs:window=16", "markov-rs-codec:window=16", "boundary-per-layer:window=16"]


def _greedy(engines, model: Model, ffn, prompts, steps: int, batched: bool) -> torch.Tensor:
    """Every session's hidden rows over `steps` greedy steps, [steps, B, H]."""
    tokens = [
        int(final_logits(model, e.prefill(model, ffn, p)[-1:]).argmax())
        for e, p in zip(engines, prompts, strict=True)
    ]
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
@pytest.mark.slow
def test_a_batch_is_each_session_alone(
    cpu_kernels, smollm2_default: Model, spec: str, monkeypatch
) -> None:
    """Sessions of 20, 40 and 70 tokens, 8 steps: the 16-row window overflows at the prefill
    and at every step (the codec engines' cold rows then re-derive their K/V)."""
    model, ffn = smollm2_default, build_ffn(smollm2_default)
    prompts = [context_ids(model, n, default_text()) for n in (20, 40, 70)]
    calls: list[int] = []
    real = residual_engine._fused_rows

    def counted(batch, *args):
        out = real(batch, *args)
        calls.append(len(batch) if out is not None else 0)
        return out

    monkeypatch.setattr(residual_engine, "_fused_rows", counted)
    together = [parse_engine(spec).build(model) for _ in prompts]
    got = _greedy(together, model, ffn, prompts, 8, batched=True)
    assert batch_groups(together) == [[0, 1, 2]]
    assert calls == [3] * 8  # one call a step for all three sessions
    alone = _greedy(
        [parse_engine(spec).build(model) for _ in prompts], model, ffn, prompts, 8, batched=False
    )
    assert torch.equal(got, alone)
    monkeypatch.setattr(residual_engine, "_fused_rows", lambda *args: None)
    by_layer = _greedy(
        [parse_engine(spec).build(model) for _ in prompts], model, ffn, prompts, 8, batched=True
    )
    assert torch.equal(got, by_layer)


@pytest.mark.parametrize(
    "spec",
    [
        "markov-rs-codec:window=16",
        # long: markov-rs-codec above splits the same compiled call (its coded cold rows' K/V
        # re-derived) over the threads
        pytest.param("boundary-per-layer:window=16", marks=pytest.mark.long),
    ],
)
def test_a_batch_on_two_threads_is_the_one_thread_batch(
    cpu_kernels, smollm2_default: Model, spec: str
) -> None:
    """The one call splits its products, attention and the evicted rows' K/V over the threads:
    on two, the same bits as on one (sessions of 20, 40 and 70 tokens, 6 steps, the window
    overflowing at each)."""
    model, ffn = smollm2_default, build_ffn(smollm2_default)
    prompts = [context_ids(model, n, default_text()) for n in (20, 40, 70)]
    runs = []
    for count in (1, 2):
        with torch_threads(count):
            engines = [parse_engine(spec).build(model) for _ in prompts]
            runs.append(_greedy(engines, model, ffn, prompts, 6, batched=True))
    assert torch.equal(runs[0], runs[1])


@pytest.mark.slow
def test_without_the_compiled_layer_the_sessions_step_in_turn(smollm2: Model) -> None:
    model, ffn = smollm2, DenseFfn(smollm2)
    prompts = [context_ids(model, n, default_text()) for n in (12, 30)]
    spec = "markov-rs:window=8"
    got = _greedy(
        [parse_engine(spec).build(model) for _ in prompts], model, ffn, prompts, 4, batched=True
    )
    alone = _greedy(
        [parse_engine(spec).build(model) for _ in prompts], model, ffn, prompts, 4, batched=False
    )
    assert torch.equal(got, alone)


def test_recompute_mode_steps_alone(smollm2_default: Model) -> None:
    engine = parse_engine("markov-rs:kv_cache=0").build(smollm2_default)
    engine.prefill(smollm2_default, build_ffn(smollm2_default), [1, 2, 3])
    assert engine.batch_key() is None


def test_a_lossy_rows_kv_is_the_float_recompute_within_rounding(
    cpu_kernels, smollm2_default: Model
) -> None:
    """The compiled re-derivation of evicted rows' K/V (block products of int16-rounded
    inputs) against `recompute_kv` over the float matrices, on the same stored rows: two
    segments (two rows at positions 3.., one at 5) of three layers, each in its own storage."""
    model, ffn = smollm2_default, build_ffn(smollm2_default)
    engine = parse_engine("markov-rs-codec:window=8").build(model)
    engine.prefill(model, ffn, context_ids(model, 30, default_text()))
    store = engine.store
    layers = [0, 7, 29]
    stored = torch.stack([store.cold_rows(layer)[3:6] for layer in layers], dim=1)  # [3, 3, H]
    shape = store.kv[0]._k._data.shape
    first = [(torch.zeros(shape), torch.zeros(shape), 2) for _ in layers]  # rows 3, 4 at 2, 3
    second = [(torch.zeros(shape), torch.zeros(shape), 9) for _ in layers]  # row 5 at 9
    assert rows_kv(model, ffn, layers, stored, [(2, 3, first), (1, 5, second)])
    for j, layer in enumerate(layers):
        k, v = recompute_kv(model, layer, stored[:, j].contiguous(), 3)  # [Hkv, 3, D]
        for row, (keys, values, slot) in [(0, first[j]), (1, first[j]), (2, second[j])]:
            at = slot + row if row < 2 else slot
            torch.testing.assert_close(keys[at], k[:, row], rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(values[at], v[:, row], rtol=2e-3, atol=2e-3)
        assert not first[j][0][:2].any() and not first[j][0][4:].any()  # nothing else written
        assert not second[j][0][:9].any() and not second[j][0][10:].any()


def test_rows_kv_refuses_stores_that_do_not_match_the_rows(cpu_kernels, smollm2_default) -> None:
    """Segments whose rows do not add up, a store list of the wrong length or slots past
    their storage are a typed refusal from the compiled call, nothing written."""
    model, ffn = smollm2_default, build_ffn(smollm2_default)
    rows = torch.randn(2, 1, model.config.hidden_size)
    shape = (4, model.config.num_kv_heads, model.config.head_dim)
    keys, values = torch.zeros(shape), torch.zeros(shape)
    with pytest.raises(RuntimeError, match="add up to the rows given"):
        rows_kv(model, ffn, [0], rows, [(1, 0, [(keys, values, 0)])])
    with pytest.raises(RuntimeError, match="one entry per segment and layer"):
        rows_kv(model, ffn, [0], rows, [(2, 0, [])])
    with pytest.raises(RuntimeError, match="slots must lie in its storage"):
        rows_kv(model, ffn, [0], rows, [(2, 0, [(keys, values, 3)])])
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
    storages = [(torch.zeros(shape), torch.zeros(shape), 0) for _ in layers]
    assert rows_kv(model, ffn, layers, rows, [(3, 4, storages)])
    for layer, (keys, values, _) in zip(layers, storages, strict=True):
        written = store.kv[layer]
        assert torch.equal(keys[:3], written.keys[:, 4:7].transpose(0, 1))
        assert torch.equal(values[:3], written.values[:, 4:7].transpose(0, 1))


@pytest.mark.parametrize("spec", ["markov-rs:window=8", "markov-rs-codec:window=8"])
def test_a_short_prompt_is_standards_prefill_in_one_call(
    cpu_kernels, smollm2_default: Model, spec: str, monkeypatch
) -> None:
    """A prompt of 40 tokens (or as many as one pass of the compiled layers takes: 16 without
    AVX-512) goes through `standard`'s one compiled call for a new prompt, its window
    overflowing at once: the same hidden rows as `standard`'s prefill, bit for bit. The lossy
    cold tier's rows get their K/V from the compiled projection, as a decode step's do; the
    lossless one then decodes exactly as `standard` does."""
    model, ffn = smollm2_default, build_ffn(smollm2_default)
    n = min(40, model_block_rows(model))
    ids = context_ids(model, n, default_text())
    calls: list[bool] = []
    real = residual_engine.prompt_in_one_call

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(residual_engine, "prompt_in_one_call", counted)
    engine, standard = parse_engine(spec).build(model), parse_engine("standard").build(model)
    h, expected = engine.prefill_all(model, ffn, ids), standard.prefill_all(model, ffn, ids)
    assert calls == [True] and torch.equal(h, expected)
    store = engine.store
    assert store.hot_len == 8 and store.cold_len == n - 8
    if spec.startswith("markov-rs-codec"):  # the evicted rows' K/V: the compiled projection's
        layers = list(range(model.config.num_layers))
        cold = torch.stack([store.cold_rows(layer) for layer in layers], dim=1)  # [n - 8, L, H]
        shape = store.kv[0]._k._data.shape
        fresh = [(torch.zeros(shape), torch.zeros(shape), 0) for _ in layers]
        assert rows_kv(model, ffn, layers, cold, [(n - 8, 0, fresh)])
        for layer, (keys, values, _) in zip(layers, fresh, strict=True):
            assert torch.equal(keys[: n - 8], store.kv[layer].keys[:, : n - 8].transpose(0, 1))
            assert torch.equal(values[: n - 8], store.kv[layer].values[:, : n - 8].transpose(0, 1))
    if spec.startswith("markov-rs:"):
        for _ in range(5):
            token = int(final_logits(model, h[-1:]).argmax())
            h, expected = (
                engine.decode_step(model, ffn, token),
                standard.decode_step(model, ffn, token),
            )
            assert torch.equal(h, expected)


@pytest.mark.parametrize("spec", [spec.replace("16", "8") for spec in SPECS])
@pytest.mark.slow
def test_a_new_prompt_rides_in_the_running_steps_bit_for_bit(
    cpu_kernels, smollm2_default: Model, spec: str, monkeypatch
) -> None:
    """Two sessions decode while two new prompts ride in their steps, in the one compiled
    call (one of 14 tokens that overflows its 8-row window at once; no longer than a pass of
    the compiled layers takes, as its prefill alone is then that call too): every session's
    logits are the ones it gets alone, bit for bit. With a lossless cold tier (`markov-rs`)
    the long prompt goes in three chunks; with a lossy one, whole, and a started session
    takes one row a step."""
    model, ffn = smollm2_default, build_ffn(smollm2_default)
    rode: list[list[int]] = []
    real = residual_engine._fused_rows

    def counted(batch, model, ffn, rows, counts):
        out = real(batch, model, ffn, rows, counts)
        if out is not None and max(counts) > 1:
            rode.append(list(counts))
        return out

    monkeypatch.setattr(residual_engine, "_fused_rows", counted)
    prompts = [context_ids(model, n, default_text()) for n in (20, 12, 14, 9)]

    def fresh(ids: list[int]) -> GenerationSession:
        engine = parse_engine(spec).build(model)
        return GenerationSession(engine, model, ffn, ids, 8, stop_ids=frozenset())

    def alone(ids: list[int]) -> list[torch.Tensor]:
        gen = fresh(ids)
        gen.prefill()
        logits = [gen.logits]
        while not gen.finished:
            gen.step()
            logits.append(gen.logits)
        return logits

    want = [alone(ids) for ids in prompts]
    sessions = [fresh(ids) for ids in prompts]
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    for i in (0, 1):
        sessions[i].prefill()
        got[i].append(sessions[i].logits)
    lossless = spec.startswith("markov-rs:")
    assert sessions[2].takes_prompt_in_batch(14)
    assert sessions[2].takes_prompt_in_batch(5) == lossless
    chunks = {2: [5, 4, 100] if lossless else [100], 3: [100]}
    waiting = {2: 1, 3: 2}  # the steps each prompt waits before it rides
    while not all(s.finished for s in sessions):
        live = [i for i, s in enumerate(sessions) if not s.finished and waiting.get(i, 0) == 0]
        sizes = [1 if sessions[i].started else chunks[i].pop(0) for i in live]
        for i, token in zip(
            live, advance_together([sessions[i] for i in live], sizes), strict=True
        ):
            if token is not None:
                got[i].append(sessions[i].logits)
        waiting = {i: max(n - 1, 0) for i, n in waiting.items()}
    if lossless:  # each prompt, and each chunk, in a step of the running sessions
        assert rode == [[1, 1, 5], [1, 1, 4, 9], [1, 1, 5, 1]]
    else:
        assert rode == [[1, 1, 14], [1, 1, 1, 9]]
    for mine, theirs in zip(got, want, strict=True):
        assert len(mine) == len(theirs)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    if not lossless:
        with pytest.raises(InvariantViolation, match="one row a step"):
            advance_batch([sessions[0].engine], model, ffn, [[1, 2]])
