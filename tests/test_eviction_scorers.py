"""The scoring eviction engines (`tova`, `keydiff`, `expected-attention`, `kvzip`, and `snapkv`,
`h2o` on the same base) on the real default model: exact when everything is kept, half the
prompt's bytes at keep=0.5, adaptive head budgets held in fewer-or-equal bytes with unequal
per-head counts, attention over packed per-head rows equal to a per-head loop, and states that
restore to the same decode."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
import torch

import larql
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate
from larql.inference.layer import (
    attend,
    embed_rows,
    final_logits,
    project_qkv,
    project_qkv_with_rope,
    rope_table,
    token_tensor,
)
from larql.inference.rope import apply_rope
from larql.inference.snapshots import SnapshotCorrupt, StateReader, StateWriter
from larql.kv import parse_engine
from larql.kv.catalog import catalog_rows
from larql.kv.eviction.ragged import RaggedRows
from larql.kv.snapshots import State
from larql.kv.spec import MalformedEngineSpec
from larql.models import Model

SCORERS = ["tova", "keydiff", "expected-attention", "kvzip"]
TEXT = (
    "Mara keeps bees on the hill above the harbour. Her oldest hive, painted green, gave "
    "forty jars of honey last summer, and the ferry captain buys half of them every year. "
    "In winter she repairs the frames in the boat shed, listening to the radio, and writes "
    "the colony counts in a red notebook that her grandmother started."
)
STEPS = 6


def ids_of(model: Model) -> list[int]:
    ids = model.tokenizer.encode(TEXT)
    assert 60 <= len(ids) <= 120
    return ids


def greedy(model: Model, spec: str) -> list[int]:
    engine = parse_engine(spec).build(model)
    return generate(
        engine, model, DenseFfn(model), ids_of(model), STEPS, stop_ids=frozenset()
    ).tokens


def prefilled(model: Model, spec: str):
    engine = parse_engine(spec).build(model)
    with torch.inference_mode():
        engine.prefill(model, DenseFfn(model), ids_of(model))
    return engine


@pytest.fixture(scope="module")
def standard_tokens(smollm2: Model) -> list[int]:
    return greedy(smollm2, "standard")


@pytest.mark.parametrize(
    "spec",
    [
        "tova:keep=1",
        # long: tova's and kvzip's keep=1 check the same store holding every row (the scorers
        # differ only in which rows they would drop)
        pytest.param("keydiff:keep=1", marks=pytest.mark.long),
        pytest.param("expected-attention:keep=1", marks=pytest.mark.long),
        "kvzip:keep=1",
        "tova:budget=512",
        # long: kvzip:keep=1 and tova:budget=512 check the same whole-prompt budget
        pytest.param("kvzip:budget=512,heads=adaptive", marks=pytest.mark.long),
        # long: test_eviction's exact_while_everything_fits checks snapkv and h2o holding
        # every row (in float64)
        pytest.param("snapkv:keep=1", marks=pytest.mark.long),
        pytest.param("h2o:keep=1", marks=pytest.mark.long),
    ],
)
def test_keeping_every_row_is_exact(spec: str, smollm2: Model, standard_tokens) -> None:
    assert greedy(smollm2, spec) == standard_tokens


@pytest.mark.parametrize(
    "spec",
    [
        "tova:keep=0.5",
        # long: the share is the budget's, the same for every scorer (the others above check
        # it); kvzip:keep=0.5 and keydiff:keep=0.5 are prefilled and decoded in the
        # adaptive-heads test too
        pytest.param("keydiff:keep=0.5", marks=pytest.mark.long),
        "expected-attention:keep=0.5",
        pytest.param("kvzip:keep=0.5", marks=pytest.mark.long),
        pytest.param("snapkv:keep=0.5", marks=pytest.mark.long),
        "h2o:keep=0.5,recent=16",
    ],
)
def test_half_kept_holds_half_the_prompt_bytes_and_decodes(spec: str, smollm2: Model) -> None:
    full = prefilled(smollm2, "standard").memory().state
    engine = prefilled(smollm2, spec)
    share = engine.memory().state / full
    # ⌈T/2⌉ of T rows; tova and h2o add a float32 score per row (1/2D of a row's K and V)
    assert 0.48 <= share <= 0.52, share
    ffn = DenseFfn(smollm2)
    with torch.inference_mode():
        for token in (11, 260, 3575):
            logits = final_logits(smollm2, engine.decode_step(smollm2, ffn, token))
            assert torch.isfinite(logits).all()
    assert engine.position == len(ids_of(smollm2)) + 3


@pytest.mark.parametrize(
    "name",
    [
        # long: keydiff and kvzip check the same one packed budget per layer
        pytest.param("tova", marks=pytest.mark.long),
        "keydiff",
        pytest.param("expected-attention", marks=pytest.mark.long),
        "kvzip",
    ],
)
def test_adaptive_heads_share_one_budget_in_no_more_bytes(name: str, smollm2: Model) -> None:
    uniform = prefilled(smollm2, f"{name}:keep=0.5")
    adaptive = prefilled(smollm2, f"{name}:keep=0.5,heads=adaptive")
    heads = smollm2.config.kv_heads_of(0)
    unequal = 0
    for even, packed in zip(uniform._layers, adaptive._layers, strict=True):
        assert isinstance(packed, RaggedRows)
        counts = packed.counts()
        assert sum(counts) == heads * len(even)  # the layer's budget, spread over its heads
        unequal += len(set(counts)) > 1
    assert unequal >= len(adaptive._layers) // 2  # most layers split it unevenly
    # the same rows in all, plus each layer's Hkv + 1 offsets
    offsets = sum(layer.offsets.numel() * 8 for layer in adaptive._layers)
    assert adaptive.memory().state - offsets <= uniform.memory().state
    ffn = DenseFfn(smollm2)
    with torch.inference_mode():
        for token in (11, 260):
            assert torch.isfinite(
                final_logits(smollm2, adaptive.decode_step(smollm2, ffn, token))
            ).all()


@pytest.mark.parametrize(
    "spec",
    [
        "keydiff:keep=0.25",
        # long: keydiff above checks the same pyramid; adaptive heads under one budget are
        # test_adaptive_heads_share_one_budget_in_no_more_bytes's
        pytest.param("snapkv:keep=0.25,heads=adaptive", marks=pytest.mark.long),
    ],
)
def test_a_pyramid_moves_the_budget_down_the_layers_in_the_same_bytes(
    spec: str, smollm2: Model
) -> None:
    ids = smollm2.tokenizer.encode(" ".join([TEXT] * 4))  # the floors (sinks + recent) far below

    def kept(spec: str):
        engine = parse_engine(spec).build(smollm2)
        with torch.inference_mode():
            engine.prefill(smollm2, DenseFfn(smollm2), ids)
        return engine

    even, pyramid = kept(spec), kept(f"{spec},layers=pyramid")
    rows = [len(layer) for layer in pyramid._layers]  # per head (on average, adaptive)
    assert rows[0] > len(even._layers[0]) > rows[-1]
    assert all(a >= b for a, b in pairwise(rows))  # never more higher up
    assert rows[0] >= 2.5 * rows[-1]  # 1.5× the budget at the bottom, 0.5× at the top
    # the same rows in all, up to rounding each layer's share up to a whole row
    assert 0 <= sum(rows) - sum(len(layer) for layer in even._layers) <= len(rows)
    assert pyramid.memory().state <= 1.05 * even.memory().state
    assert "layers=pyramid" in pyramid.config() and "layers" not in even.config()
    with torch.inference_mode():
        hidden = pyramid.decode_step(smollm2, DenseFfn(smollm2), 11)
    assert torch.isfinite(final_logits(smollm2, hidden)).all()


def test_kvzip_across_layers_keeps_one_budget_for_the_model(smollm2: Model) -> None:
    """layers=adaptive: the rows picked across every layer and head by raw score — the layers'
    and heads' counts differ, their sum is the uniform budget's, the protected rows stay."""
    ids = smollm2.tokenizer.encode(" ".join([TEXT] * 2))  # the floors (sinks + recent) far below
    engines = {}
    for spec in ("kvzip:keep=0.25", "kvzip:keep=0.25,layers=adaptive"):
        engines[spec] = engine = parse_engine(spec).build(smollm2)
        with torch.inference_mode():
            engine.prefill(smollm2, DenseFfn(smollm2), ids)
    even, across = engines.values()
    counts = [layer.counts() for layer in across._layers]
    assert sum(map(sum, counts)) == sum(len(layer) * 3 for layer in even._layers)
    assert len({sum(c) for c in counts}) > 5  # the layers hold different shares
    floor = across.budget.sinks + across.budget.recent
    assert min(min(c) for c in counts) >= floor
    fork = across.fork(smollm2)
    ffn = DenseFfn(smollm2)
    with torch.inference_mode():
        assert torch.equal(across.decode_step(smollm2, ffn, 11), fork.decode_step(smollm2, ffn, 11))


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_attention_is_a_per_head_loop(seed: int, smollm2: Model) -> None:
    """Each head attends over its own rows only: packed rows of unequal counts, then a decoded
    row (the tail), then the tail folded in — the output a loop of `attend` per head gives."""
    model = smollm2
    with torch.inference_mode():
        h, _ = embed_rows(model, token_tensor(model, ids_of(model)[:40]))
        q, k, v = project_qkv(model, 0, h, 0)  # rows of layer 0's input
        heads, t, _ = k.shape
        group = q.shape[0] // heads
        generator = torch.Generator().manual_seed(seed)
        picked = (
            torch.rand(heads, t, generator=generator) < torch.tensor([0.3, 0.6, 0.9])[:heads, None]
        )
        head, position = picked.nonzero(as_tuple=True)
        rows = RaggedRows.picked(k, v, head, position)
        own = [k[i, picked[i]] for i in range(heads)], [v[i, picked[i]] for i in range(heads)]

        def reference(query: torch.Tensor) -> torch.Tensor:
            outs = [
                attend(
                    model,
                    0,
                    query[i * group : (i + 1) * group],
                    own[0][i][None],
                    own[1][i][None],
                    0,
                    None,
                )
                for i in range(heads)
            ]
            return torch.cat(outs, dim=-1)

        query = q[:, -1:]
        assert torch.allclose(rows.attend(model, 0, query), reference(query), atol=1e-5)
        rows.append(k[:, -1:], v[:, -1:])
        own = (
            [torch.cat((o, k[i, -1:])) for i, o in enumerate(own[0])],
            [torch.cat((o, v[i, -1:])) for i, o in enumerate(own[1])],
        )
        expected = reference(q[:, -2:-1])
        assert torch.allclose(rows.attend(model, 0, q[:, -2:-1]), expected, atol=1e-5)
        rows.merge()
        assert len(rows.tail) == 0
        assert torch.allclose(rows.attend(model, 0, q[:, -2:-1]), expected, atol=1e-5)


@pytest.mark.parametrize("queries", [0, 32])
def test_expected_attention_scores_are_the_published_formula(queries: int, smollm2: Model):
    """Layer 0's scores on a prompt longer than 128 tokens against the method written out:
    the statistics of the queries after the 4 sinks (or the last `queries`) before RoPE, the
    rotation averaged over the next 512 positions, a softmax per query head over the non-sink
    rows, the group's mean, × ‖v‖; the sinks scored as the best row."""
    model, sinks, future = smollm2, 4, 512
    ids = model.tokenizer.encode(TEXT + " " + TEXT)
    assert len(ids) > 128
    engine = parse_engine(f"expected-attention:keep=0.5,queries={queries}").build(model)
    with torch.inference_mode():
        h, _ = embed_rows(model, token_tensor(model, ids))
        q, k, v = project_qkv(model, 0, h, 0)
        got = engine._row_scores(model, 0, engine._observe(model, 0, None, q, 0, k), k, v)
        cos, sin = rope_table(model, 0).slice(0, len(ids))
        plain = project_qkv_with_rope(model, 0, h, torch.ones_like(cos), torch.zeros_like(sin))[0]
        plain = plain[:, sinks:][:, -queries:].double()  # [Hq, n, D], unrotated
        mean = plain.mean(dim=1, keepdim=True)
        cov = (plain - mean).transpose(1, 2) @ (plain - mean) / plain.shape[1]
        cos, sin = rope_table(model, 0).slice(len(ids), future)
        dim = q.shape[-1]
        basis = torch.eye(dim, dtype=cos.dtype).expand(future, dim, dim)
        rotation = apply_rope(basis, cos[:, None], sin[:, None]).double().mean(0).T  # mean R(p)
        mu, sigma = mean @ rotation.T, rotation @ cov @ rotation.T
        keys, s = k[:, sinks:].double(), model.config.attn_scale
        group = q.shape[0] // k.shape[0]
        want = []
        for head in range(q.shape[0]):
            kv = keys[head // group]
            z = s * kv @ mu[head, 0] + s * s / 2 * ((kv @ sigma[head]) * kv).sum(-1)
            want.append(torch.softmax(z, dim=0))
        want = torch.stack(want).view(k.shape[0], group, -1).mean(1)
        want = want * v[:, sinks:].double().norm(dim=-1)
    assert torch.allclose(got[:, sinks:].double(), want, rtol=1e-4, atol=1e-9)
    assert torch.equal(got[:, :sinks], got.amax(dim=-1, keepdim=True).expand(-1, sinks))


def decode(engine, model: Model, tokens: list[int]) -> list[torch.Tensor]:
    ffn = DenseFfn(model)
    with torch.inference_mode():
        return [final_logits(model, engine.decode_step(model, ffn, t))[0] for t in tokens]


@pytest.mark.parametrize(
    "spec",
    [
        # long: tova:keep=0.5,layers=pyramid saves the same even rows (a count per layer); kvzip
        # and h2o adaptive the same packed rows and offsets
        pytest.param("tova:keep=0.5", marks=pytest.mark.long),
        pytest.param("tova:keep=0.5,heads=adaptive", marks=pytest.mark.long),
        pytest.param("keydiff:keep=0.5,heads=adaptive", marks=pytest.mark.long),
        pytest.param("expected-attention:keep=0.5", marks=pytest.mark.long),
        "kvzip:keep=0.5,heads=adaptive",
        "h2o:keep=0.5,recent=8,heads=adaptive",
        "tova:keep=0.5,layers=pyramid",
    ],
)
def test_a_restored_state_decodes_as_the_original(spec: str, smollm2: Model, tmp_path: Path):
    ids = ids_of(smollm2)
    state = larql.prefill(smollm2, spec, ids)
    decode(state.engine, smollm2, [11, 260])  # decoded rows too (and, evicting, evicted ones)
    with torch.inference_mode():
        hidden = state.engine.decode_step(smollm2, DenseFfn(smollm2), 42)
    state = State(smollm2, state.engine, hidden, (*ids, 11, 260, 42))
    state.save(tmp_path / "state")
    restored = larql.load_state(smollm2, tmp_path / "state")
    assert restored.position == state.position == len(ids) + 3
    more = [11, 260, 3575]
    for a, b in zip(
        decode(state.engine, smollm2, more), decode(restored.engine, smollm2, more), strict=True
    ):
        assert torch.equal(a, b)


def test_packed_offsets_are_checked_on_load(smollm2: Model) -> None:
    engine = prefilled(smollm2, "keydiff:keep=0.5,heads=adaptive")
    writer = StateWriter()
    engine.write_state(writer)
    writer.tensors["layers.3.offsets"][1] = 10**6  # a head of more rows than positions
    fresh = parse_engine("keydiff:keep=0.5,heads=adaptive").build(smollm2)
    fresh.position = engine.position
    with pytest.raises(SnapshotCorrupt, match=r"layers\.3\.offsets"):
        fresh.read_state(StateReader(writer.fields, writer.tensors), smollm2)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tova:keep=0", "must be in (0, 1]"),
        ("keydiff:keep=1.5", "must be in (0, 1]"),
        ("kvzip:keep=0.5,budget=64", "keep or budget, not both"),
        ("snapkv:keep=0.5,budget=64", "keep or budget, not both"),
        ("expected-attention:heads=mixed", "must be one of uniform, adaptive"),
        ("expected-attention:queries=1", "must be 0 (every query) or ≥ 2"),
        ("keydiff:layers=cone", "must be one of uniform, pyramid, adaptive"),
        ("keydiff:layers=adaptive", "needs every layer's scores before any is cut"),
        ("snapkv:layers=adaptive", "needs every layer's scores before any is cut"),
    ],
)
def test_bad_selections_are_refused(spec: str, message: str) -> None:
    with pytest.raises(MalformedEngineSpec) as raised:
        parse_engine(spec).build()
    assert message in str(raised.value)


def test_the_catalog_states_kvzip_s_second_pass() -> None:
    rows = {row["name"]: row for row in catalog_rows()}
    assert "~3×" in rows["kvzip"]["contract"]
    for name in SCORERS:
        assert {"keep", "budget", "sinks", "recent", "heads", "layers"} <= {
            p["name"] for p in rows[name]["params"]
        }
