"""Eviction composed with a quantiser (`snapkv:…+turbo-quant:…`) on the real default model: what
the eviction keeps is coded by the quantiser's own store and attended by its own path (with
every row kept, the quantiser alone), the bytes held are the product of the two, decode appends
coded rows, and only a compress-once eviction followed by a quantiser parses."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from helpers import relative_error, teacher_forced
from larql.cli.app import app
from larql.inference.batching import decode_batch
from larql.inference.ffn import DenseFfn
from larql.inference.layer import final_logits
from larql.kv import CATALOG, parse_engine
from larql.kv.composed import ComposedSpec, CompositionRefused
from larql.kv.composed.ragged import RaggedCodes
from larql.kv.composed.storage import KeptCodes
from larql.kv.spec import BeyondBound, EngineSpecError, SpecPolicy
from larql.models import Model
from larql.server.app import create_app
from larql.server.settings import ServerSettings
from tiny_models import random_ids

PROMPT = "The quick brown fox jumps over the lazy dog because it was tired of waiting for"
LONG = " ".join(
    ["The Apache License, Version 2.0, governs how the software may be used and shared."] * 6
)


@pytest.mark.parametrize(
    ("composed", "alone"),
    [
        # the quantiser's own recent window, written out: the composition's default is none
        ("snapkv:budget=4096+turbo-quant:bits=4,recent=8", "turbo-quant:bits=4,recent=8"),
        # long: bits=4,recent=8 above checks the same store and path
        pytest.param(
            "snapkv:budget=4096+turbo-quant:bits=3",
            "turbo-quant:bits=3,recent=0",
            marks=pytest.mark.long,
        ),
        ("snapkv:budget=4096+kv-quant:bits=4,sinks=2", "kv-quant:bits=4,sinks=2"),
    ],
)
@pytest.mark.slow
def test_keeping_every_row_is_the_quantiser_alone(composed: str, alone: str, smollm2: Model):
    """Same stored codes, same attention: the logits agree to float rounding."""
    ids = smollm2.tokenizer.encode(PROMPT)
    ours = teacher_forced(smollm2, composed, ids, len(ids) - 6)
    reference = teacher_forced(smollm2, alone, ids, len(ids) - 6)
    assert relative_error(ours, reference) <= 1e-5
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def _prefilled(spec: str, model: Model, ids: list[int]):
    engine = parse_engine(spec).build(model)
    with torch.inference_mode():
        engine.prefill(model, DenseFfn(model), ids)
    return engine


def test_bytes_held_are_the_product_and_decode_appends_codes(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(LONG)
    kept = 24 + 8  # budget + window of each layer and K/V head
    assert len(ids) >= 3 * kept
    both = _prefilled("snapkv:budget=24,window=8+turbo-quant:bits=4", smollm2, ids)
    evicted = _prefilled("snapkv:budget=24,window=8", smollm2, ids)
    coded = _prefilled("turbo-quant:bits=4,recent=0", smollm2, ids)
    state = both.memory().state
    assert state < evicted.memory().state and state < coded.memory().state
    # the same sink rows and prompt mean as the quantiser alone; of the codes, the kept rows'
    row_bytes = sum(layer.row_bytes for layer in both._layers)
    assert coded.memory().state - state == (len(ids) - kept) * row_bytes
    assert all(isinstance(layer, KeptCodes) and len(layer) == kept for layer in both._layers)
    with torch.inference_mode():
        for token in ids[:3]:
            hidden = both.decode_step(smollm2, DenseFfn(smollm2), token)
    assert torch.isfinite(hidden).all()
    for layer in both._layers:  # each decoded row coded into the store
        assert len(layer) == kept + 3 and len(layer.codes) == kept + 3 - len(layer.sinks)
    assert both.info().name == "snapkv+turbo-quant"
    assert "turbo-quant" in both.info().description


# long: keeping_every_row_is_the_quantiser_alone checks this store's path exactly, and
# adaptive_composition_stays_close_to_the_eviction_alone the same closeness under an eviction
@pytest.mark.long
def test_a_real_eviction_stays_close_to_the_eviction_alone(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(LONG)
    prompt = len(ids) - 4
    both = teacher_forced(smollm2, "snapkv:budget=32,window=8+turbo-quant:bits=4", ids, prompt)
    evicted = teacher_forced(smollm2, "snapkv:budget=32,window=8", ids, prompt)
    assert 0 < relative_error(both, evicted) <= 0.25
    assert (both.argmax(-1) == evicted.argmax(-1)).float().mean() >= 0.8


def test_a_prompt_in_parts_keeps_what_one_prefill_keeps(smollm2: Model) -> None:
    spec = "snapkv:budget=16,window=4+turbo-quant:bits=4"
    ids = smollm2.tokenizer.encode(LONG)[:60]
    whole = _prefilled(spec, smollm2, ids)
    parts = parse_engine(spec).build(smollm2)
    ffn = DenseFfn(smollm2)
    with torch.inference_mode():
        parts.prefill_part(smollm2, ffn, ids[:25], more=True)
        parts.prefill_part(smollm2, ffn, ids[25:], more=False)
        parts.finish_prompt(10**6)
    # the parts' K/V differ from the whole prompt's in float rounding, which moves a code by
    # one level here and there
    for a, b in zip(whole._layers, parts._layers, strict=True):
        assert len(a) == len(b) and (a.codes.rows == b.codes.rows).float().mean() >= 0.95


@pytest.mark.parametrize(
    "spec",
    [
        "snapkv:budget=64+turbo-quant:bits=4",
        "snapkv:budget=64,window=16,kernel=5+turbo-quant:bits=3,recent=0,recent_bits=8",
        "snapkv+kv-quant:bits=2,group=64",
        "SnapKV:budget=8+TQ3",
    ],
)
def test_specs_round_trip(spec: str) -> None:
    parsed = parse_engine(spec)
    assert isinstance(parsed, ComposedSpec)
    assert parse_engine(parsed.spec()) == parsed
    assert parsed.display_name == f"{parsed.eviction.entry.name}+{parsed.quantiser.entry.name}"


@pytest.mark.parametrize("separator", [",", ";"])
def test_engine_lists_keep_a_composition_whole(separator: str) -> None:
    listed = separator.join(
        ["standard", "snapkv:budget=64,window=16+turbo-quant:bits=4,recent=0", "kv-quant"]
    )
    assert [parse_engine(s).spec() for s in CATALOG.split_specs(listed)] == [
        "standard",
        "snapkv:budget=64,window=16+turbo-quant:recent=0",
        "kv-quant",
    ]


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("h2o:budget=64+turbo-quant", "recent must be < budget"),
        ("turbo-quant+snapkv", "write the eviction first"),
        ("snapkv+standard", "standard is not a quantiser"),
        ("standard+turbo-quant", "standard is not an eviction engine"),
        ("snapkv+", "an engine on each side"),
        ("+turbo-quant", "an engine on each side"),
        ("snapkv+turbo-quant+kv-quant", "names 3 engines"),
        ("snapkv:budget=8+nonsense", "nonsense"),
    ],
)
def test_bad_compositions_are_typed_errors(spec: str, why: str) -> None:
    with pytest.raises(EngineSpecError, match=why) as raised:
        parse_engine(spec)
    if isinstance(raised.value, CompositionRefused):
        message = str(raised.value)
        assert "\n" not in message
        assert "(snapkv" in message and "(turbo-quant, kv-quant)" in message


def test_cli_refuses_a_bad_composition_in_one_line(smollm2_default: Model) -> None:
    result = CliRunner().invoke(app, ["run", "Hello", "-n", "1", "--engine", "turbo-quant+h2o"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: 'turbo-quant+h2o': write the eviction")


@pytest.mark.parametrize(
    "spec",
    ["snapkv:budget=100000+turbo-quant", "snapkv+turbo-quant:recent=100000,sinks=4"],
)
def test_a_request_is_bounded_in_both_halves(spec: str, smollm2: Model) -> None:
    parse_engine(spec)  # the operator's: accepted
    with pytest.raises(BeyondBound, match="100000"):
        parse_engine(spec, SpecPolicy.untrusted(smollm2))
    parsed = parse_engine(spec)
    with pytest.raises(BeyondBound):
        parsed.check(SpecPolicy.untrusted(smollm2, max_tokens=512))


def test_a_request_may_name_a_composition(smollm2: Model) -> None:
    """It runs; a bad one is a 400 naming the engine field."""
    settings = ServerSettings(max_prompt_tokens=24, max_new_tokens=4)
    asked = {"prompt": "Once upon a time there was", "max_tokens": 3, "temperature": 0}
    with TestClient(create_app(smollm2, settings)) as client:
        for spec in ("snapkv:budget=4,window=2+tq4", "h2o:budget=4,recent=2+kv-quant:bits=4"):
            ok = client.post("/v1/completions", json={**asked, "engine": spec})
            assert ok.status_code == 200, ok.text
            assert ok.json()["usage"]["completion_tokens"] == 3
        for spec, words in [
            ("snapkv:budget=4+turbo-quant:recent=29", "turbo-quant: recent=29 is more than"),
            ("snapkv:budget=29+kv-quant", "snapkv: budget=29 is more than"),
            ("standard+kv-quant", "standard is not an eviction engine"),
        ]:
            refused = client.post("/v1/completions", json={**asked, "engine": spec})
            assert refused.status_code == 400, (spec, refused.text)
            error = refused.json()["error"]
            assert error["param"] == "engine" and words in error["message"], error


@pytest.mark.slow
@pytest.mark.parametrize(
    "quantiser",
    [
        # long: test_decode_time_eviction_forks_and_batches_as_alone[tova:…+kv-quant:bits=4]
        # batches sessions of one composition against each alone (evicting as they decode too)
        pytest.param("turbo-quant:bits=4", marks=pytest.mark.long),
        pytest.param("kv-quant:bits=4", marks=pytest.mark.long),
    ],
)
def test_sessions_of_one_composition_decode_in_a_batch_as_alone(
    quantiser: str, smollm2: Model
) -> None:
    spec = f"snapkv:budget=8,window=4+{quantiser}"
    prompts = [PROMPT, "Alice put the red ball in the box, and Bob took it out again"]
    steps = [[11, 260, 3575], [260, 11, 42]]
    ffn = DenseFfn(smollm2)
    alone, batched = [], []
    for prompt, tokens in zip(prompts, steps, strict=True):
        engine = _prefilled(spec, smollm2, smollm2.tokenizer.encode(prompt))
        with torch.inference_mode():
            alone.append(torch.cat([engine.decode_step(smollm2, ffn, t) for t in tokens]))
        batched.append(_prefilled(spec, smollm2, smollm2.tokenizer.encode(prompt)))
    assert batched[0].batch_key() == batched[1].batch_key() is not None
    assert parse_engine("snapkv:budget=8").build(smollm2).batch_key() is None
    with torch.inference_mode():
        rows = [decode_batch(batched, smollm2, ffn, list(t)) for t in zip(*steps, strict=True)]
    # a float rounding apart (the rows' projections in one product) can move a coordinate of a
    # new row across a code boundary: the states then differ by a code, not the path
    for i, reference in enumerate(alone):
        ours = torch.cat([step[i : i + 1] for step in rows])  # [steps, H]
        assert relative_error(ours, reference) <= 2e-3
    assert [len(layer) for layer in batched[0]._layers] == [12 + 3] * len(batched[0]._layers)


# ---------------------------------------------------------------- heads=adaptive composed


@pytest.mark.slow
def test_adaptive_keeping_every_row_is_the_quantiser_alone(smollm2: Model) -> None:
    """Each head's rows in a store of its own, the decoded rows in one more: with every row
    kept, the same codes and the same attention as the quantiser's one store."""
    ids = smollm2.tokenizer.encode(PROMPT)
    composed = "snapkv:budget=4096,heads=adaptive+turbo-quant:bits=4,center=1"
    ours = teacher_forced(smollm2, composed, ids, len(ids) - 6)
    reference = teacher_forced(smollm2, "turbo-quant:bits=4,recent=0,center=1", ids, len(ids) - 6)
    assert relative_error(ours, reference) <= 1e-4
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_adaptive_composition_holds_each_heads_own_rows_coded(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(LONG)
    # keydiff scores the prompt in its one pass (kvzip's second pass made its three prefills
    # most of this test's time); kvzip's adaptive heads compose in the closeness test below
    spec = "keydiff:keep=0.25,heads=adaptive"
    both = _prefilled(f"{spec}+turbo-quant:bits=4", smollm2, ids)
    evicted = _prefilled(spec, smollm2, ids)
    uniform = _prefilled("keydiff:keep=0.25+turbo-quant:bits=4", smollm2, ids)
    for coded, rows in zip(both._layers, evicted._layers, strict=True):
        assert isinstance(coded, RaggedCodes)
        assert coded.counts() == rows.counts()  # the policy's rows, each head its own count
    assert len(set(both._layers[0].counts())) > 1  # the heads really keep different counts
    # the same count of rows coded as with one count per head: within what each head's store
    # holds of its own (its prompt mean, the tail's beside them; 120 tokens make it show)
    assert both.memory().state < 0.3 * evicted.memory().state
    assert uniform.memory().state < both.memory().state <= 1.2 * uniform.memory().state
    ffn = DenseFfn(smollm2)
    fork = both.fork(smollm2)  # through the saved state: every store written and read back
    with torch.inference_mode():
        for token in ids[:3]:
            ours = both.decode_step(smollm2, ffn, token)
            theirs = fork.decode_step(smollm2, ffn, token)
            assert torch.equal(ours, theirs)
    assert [c.counts() for c in both._layers] == [
        [n + 3 for n in r.counts()] for r in evicted._layers
    ]
    assert both.memory().state > 0 and torch.isfinite(ours).all()


@pytest.mark.slow
def test_adaptive_composition_stays_close_to_the_eviction_alone(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(LONG)
    prompt = len(ids) - 4
    spec = "kvzip:keep=0.5,heads=adaptive"
    both = teacher_forced(smollm2, f"{spec}+turbo-quant:bits=4", ids, prompt)
    evicted = teacher_forced(smollm2, spec, ids, prompt)
    assert 0 < relative_error(both, evicted) <= 0.25
    assert (both.argmax(-1) == evicted.argmax(-1)).float().mean() >= 0.8


# long: test_decode_time_eviction_forks_and_batches_as_alone[tova:…+kv-quant:bits=4] batches
# the same per-head stores of kv-quant codes and checks them against each alone
@pytest.mark.long
def test_adaptive_sessions_decode_in_a_batch_as_alone(smollm2: Model) -> None:
    spec = "kvzip:budget=8,heads=adaptive+kv-quant:bits=4"
    prompts = [PROMPT, "Alice put the red ball in the box, and Bob took it out again"]
    steps = [[11, 260, 3575], [260, 11, 42]]
    ffn = DenseFfn(smollm2)
    alone, batched = [], []
    for prompt, tokens in zip(prompts, steps, strict=True):
        engine = _prefilled(spec, smollm2, smollm2.tokenizer.encode(prompt))
        with torch.inference_mode():
            alone.append(torch.cat([engine.decode_step(smollm2, ffn, t) for t in tokens]))
        batched.append(_prefilled(spec, smollm2, smollm2.tokenizer.encode(prompt)))
    with torch.inference_mode():
        rows = [decode_batch(batched, smollm2, ffn, list(t)) for t in zip(*steps, strict=True)]
    for i, reference in enumerate(alone):
        ours = torch.cat([step[i : i + 1] for step in rows])  # [steps, H]
        assert relative_error(ours, reference) <= 2e-3


# ---------------------------------------------------------------- evicting while decoding


def _greedy(engine, model: Model, ids: list[int], steps: int) -> list[int]:
    """The prompt, then `steps` greedy tokens, each decoded in turn."""
    ffn = DenseFfn(model)
    with torch.inference_mode():
        hidden = engine.prefill(model, ffn, ids)[-1:]
        tokens = []
        for _ in range(steps):
            tokens.append(int(final_logits(model, hidden)[0].argmax()))
            hidden = engine.decode_step(model, ffn, tokens[-1])
    return tokens


def test_decode_time_eviction_holds_its_budget_in_codes(smollm2: Model) -> None:
    """`h2o` composed with turbo-quant drops rows from the store as it decodes: every layer
    holds exactly the rows the budget allows at each position, as codes (the quantiser's
    sinks aside), and what the stores allocate does not grow."""
    spec = "h2o:keep=0.25,recent=4+turbo-quant:bits=4"
    ids = smollm2.tokenizer.encode(LONG)
    engine = _prefilled(spec, smollm2, ids)
    alone = _prefilled("h2o:keep=0.25,recent=4", smollm2, ids)
    budget = engine.budget  # type: ignore[attr-defined]
    ffn = DenseFfn(smollm2)
    allocated = [layer.codes.capacity for layer in engine._layers]
    with torch.inference_mode():
        for token in [11, 260, 3575, 42, 11, 260, 3575, 42, 11]:
            engine.decode_step(smollm2, ffn, token)
            alone.decode_step(smollm2, ffn, token)
            rows = budget.per_head(engine.position)
            for layer in engine._layers:
                assert isinstance(layer, KeptCodes) and len(layer) == rows
                assert layer.score is not None and layer.score.shape == (layer.kv_heads, rows)
    assert engine.position - len(ids) == 9 and rows == 33  # decoded past the prompt's 30
    coded = sum(len(layer.codes) * layer.row_bytes for layer in engine._layers)
    # the quantiser's sinks: K and V of each head at 16 bits (a float32 model's in float16)
    exact = sum(len(layer.sinks) * layer.kv_heads * 2 * 64 * 2 for layer in engine._layers)
    scored = sum(4 * (layer.score.numel() + layer.mean.numel()) for layer in engine._layers)
    assert engine.memory().state == coded + exact + scored
    assert engine.memory().state < 0.25 * alone.memory().state
    # the dropped rows' room is reused: the codes' storage never grew while decoding
    assert [layer.codes.capacity for layer in engine._layers] == allocated


def test_drop_rows_keeps_each_heads_own_rows(smollm2: Model) -> None:
    """A store of real K/V (2 exact sinks, codes, 3 exact recent rows): each head keeps other
    rows, a sink and a recent row among the dropped; every kept row reads back as before — an
    exact row leaving its window coded as the quantiser codes it."""
    ids = smollm2.tokenizer.encode(PROMPT)
    engine = _prefilled("h2o:budget=64,recent=8+kv-quant:bits=8,sinks=2,recent=3", smollm2, ids)
    store = engine._layers[3]
    n, score = len(store), store.score
    before_k, before_v = store.keys_values(torch.float32, None)  # [Hkv, n, D]
    drop = [[0, 5, n - 1], [7, 8, 9], [1, n - 2, n - 3]]  # per head: the rows it loses
    index = torch.stack(
        [torch.tensor([i for i in range(n) if i not in d]) for d in drop]
    )  # [Hkv, n - 3]
    with torch.inference_mode():
        store.keep(index)
    # the sinks and recent rows every head still keeps exact (1 each); the rest are codes
    assert len(store) == n - 3 and len(store.sinks) == 1 and len(store.recent) == 1
    assert store.sink_room == 1  # a store that lost a sink takes no new ones
    after_k, after_v = store.keys_values(torch.float32, None)
    for h in range(3):
        for ours, theirs in ((after_k[h], before_k[h]), (after_v[h], before_v[h])):
            wanted = theirs[index[h]]
            assert relative_error(ours, wanted) <= 0.01
            assert torch.equal(ours[[0, -1]], wanted[[0, -1]])  # still exact: unchanged
    assert torch.equal(store.score, torch.gather(score, 1, index))


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2: Model) -> Model:
    return smollm2.to(dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "eviction", ["h2o:budget=10,recent=3", "tova:budget=10,sinks=1,recent=2,heads=adaptive"]
)
def test_decode_time_eviction_over_exact_rows_is_the_eviction_alone(
    eviction: str, smollm2_bf16: Model
) -> None:
    """A quantiser holding every row exact (its recent window wider than the budget; bfloat16,
    the dtype exact rows are kept in): the composition drops the very rows the eviction alone
    drops, by the same scores, and decodes the same tokens (4 steps past a prompt the budget
    already cut: each step drops a row)."""
    model = smollm2_bf16
    ids = model.tokenizer.encode(PROMPT)
    both = parse_engine(f"{eviction}+kv-quant:bits=8,recent=64").build(model)
    alone = parse_engine(eviction).build(model)
    assert _greedy(both, model, ids, 4) == _greedy(alone, model, ids, 4)
    for ours, theirs in zip(both._layers, alone._layers, strict=True):
        assert torch.equal(ours.score, theirs.score)
        if isinstance(ours, RaggedCodes):
            assert ours.counts() == theirs.counts()
        else:
            assert len(ours) == len(theirs) == 10


# long: over_exact_rows_is_the_eviction_alone[h2o:…] checks the same rows dropped as the eviction
# alone, and holds_its_budget_in_codes the coded decode of a decode-time eviction
@pytest.mark.long
def test_decode_time_eviction_over_8_bit_codes_decodes_as_the_eviction_alone(
    smollm2: Model,
) -> None:
    """Rows coded at 8 bits (the quantiser's window none): the same greedy tokens."""
    ids = smollm2.tokenizer.encode(PROMPT)
    both = parse_engine("h2o:budget=10,recent=3+kv-quant:bits=8").build(smollm2)
    alone = parse_engine("h2o:budget=10,recent=3").build(smollm2)
    assert _greedy(both, smollm2, ids, 6) == _greedy(alone, smollm2, ids, 6)
    assert all(len(layer) == 10 and len(layer.codes) == 10 for layer in both._layers)


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec",
    [
        # long: test_snapshots round-trips h2o:…+turbo-quant's state (a fork is the same declared
        # state), and the tova case below batches a decode-time eviction against each alone
        pytest.param("h2o:budget=8,recent=2+turbo-quant:bits=4", marks=pytest.mark.long),
        "tova:budget=8,sinks=1,recent=2,heads=adaptive+kv-quant:bits=4",
    ],
)
def test_decode_time_eviction_forks_and_batches_as_alone(spec: str, smollm2: Model) -> None:
    prompts = [PROMPT, "Alice put the red ball in the box, and Bob took it out again"]
    steps = [[11, 260, 3575], [260, 11, 42]]
    ffn = DenseFfn(smollm2)
    alone, batched = [], []
    for prompt, tokens in zip(prompts, steps, strict=True):
        engine = _prefilled(spec, smollm2, smollm2.tokenizer.encode(prompt))
        fork = engine.fork(smollm2)  # through the saved state, scores included
        with torch.inference_mode():
            alone.append(torch.cat([engine.decode_step(smollm2, ffn, t) for t in tokens]))
            forked = torch.cat([fork.decode_step(smollm2, ffn, t) for t in tokens])
        assert torch.equal(forked, alone[-1])
        batched.append(_prefilled(spec, smollm2, smollm2.tokenizer.encode(prompt)))
    assert batched[0].batch_key() == batched[1].batch_key() is not None
    with torch.inference_mode():
        rows = [decode_batch(batched, smollm2, ffn, list(t)) for t in zip(*steps, strict=True)]
    for i, reference in enumerate(alone):
        ours = torch.cat([step[i : i + 1] for step in rows])  # [steps, H]
        assert relative_error(ours, reference) <= 2e-3
    for layer in batched[0]._layers:  # the batch evicted as it went, too
        assert len(layer) == 8 and layer.score.shape[-1] == 8 * (
            1 if isinstance(layer, KeptCodes) else 3
        )


def test_cli_runs_h2o_with_turbo_quant(smollm2_default: Model) -> None:
    result = CliRunner().invoke(
        app,
        [
            "run",
            "The capital of France is",
            "-n",
            "8",
            "--engine",
            "h2o:keep=0.5+turbo-quant:bits=4",
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.output.strip()


# ---------------------------------------------------------------- sliding layers (tiny gemma3)


@pytest.mark.parametrize(
    ("composed", "alone"),
    [
        ("snapkv:budget=4096+turbo-quant:bits=3", "turbo-quant:bits=3,recent=0"),
        ("keydiff:budget=4096+kv-quant:bits=4,sinks=2", "kv-quant:bits=4,sinks=2"),
    ],
)
def test_a_sliding_layer_keeps_its_window_coded_as_the_quantiser_alone(
    composed: str, alone: str, tiny_gemma3: Model
) -> None:
    """tiny gemma3 (sliding layers of 6 keys): with every row of the global layers kept, the
    composition holds each sliding layer's window in the quantiser's store, coded as the
    quantiser alone codes it: the same logits, the same rows, the same bytes."""
    ids = random_ids(24, seed=11)
    ours = teacher_forced(tiny_gemma3, composed, ids, 9)
    reference = teacher_forced(tiny_gemma3, alone, ids, 9)
    assert relative_error(ours, reference) <= 1e-9
    both, only = _prefilled(composed, tiny_gemma3, ids), _prefilled(alone, tiny_gemma3, ids)
    for layer, spec in enumerate(tiny_gemma3.config.layers):
        held = both._layers[layer]
        assert isinstance(held, KeptCodes)
        expected = len(ids) if spec.sliding_window is None else spec.sliding_window - 1
        assert len(held) == expected
    assert both.memory().total == only.memory().total


def test_a_composition_on_sliding_layers_forks_and_batches_as_alone(tiny_gemma3: Model) -> None:
    """Evicting on the global layers, coding every layer: a fork (through the saved state)
    decodes as its source, and two sessions decode in one batch as each alone."""
    spec = "snapkv:budget=6,window=2+turbo-quant:bits=4"
    prompts, steps = [random_ids(20, seed=3), random_ids(17, seed=5)], [[5, 9, 2], [7, 1, 4]]
    ffn = DenseFfn(tiny_gemma3)
    alone, batched = [], []
    for ids, tokens in zip(prompts, steps, strict=True):
        engine = _prefilled(spec, tiny_gemma3, ids)
        fork = engine.fork(tiny_gemma3)
        with torch.inference_mode():
            alone.append(torch.cat([engine.decode_step(tiny_gemma3, ffn, t) for t in tokens]))
            forked = torch.cat([fork.decode_step(tiny_gemma3, ffn, t) for t in tokens])
        assert torch.equal(forked, alone[-1])
        batched.append(_prefilled(spec, tiny_gemma3, ids))
    with torch.inference_mode():
        rows = [decode_batch(batched, tiny_gemma3, ffn, list(t)) for t in zip(*steps, strict=True)]
    for i, reference in enumerate(alone):
        ours = torch.cat([step[i : i + 1] for step in rows])  # [steps, H]
        assert relative_error(ours, reference) <= 1e-6
    for layer, held in enumerate(batched[0]._layers):  # every layer coded, windows bounded
        window = tiny_gemma3.config.layers[layer].sliding_window
        assert isinstance(held, KeptCodes)
        assert len(held) == (6 + 2 + 3 if window is None else window - 1)  # budget + window
