"""The apollo retrieval engine: its store format and validation, routing and entry scoring on
hand-made stores, its typed misses, its refusal by `larql run`, and — on the real default model —
a store built by `larql apollo build-store` whose injection raises the probability of the fact it
was built from."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from larql.cli.app import app
from larql.errors import LarqlError
from larql.inference.engine import Engine, RetrievalEngine
from larql.inference.errors import RetrievalMiss
from larql.inference.ffn import DenseFfn
from larql.inference.forward import run_layers
from larql.inference.generation import generate
from larql.inference.layer import embed, final_logits, token_tensor
from larql.kv import parse_engine
from larql.kv.apollo.builder import BuildOptions, build_store
from larql.kv.apollo.engine import ApolloEngine
from larql.kv.apollo.retrieval import retrieve_entries
from larql.kv.apollo.routing import WindowRouter, idf
from larql.kv.apollo.store import (
    ENTRY_DTYPE,
    ApolloStore,
    ArchConfig,
    StoreCountMismatch,
    StoreFormatError,
    StoreManifest,
    StoreModelMismatch,
    StoreNotFound,
)
from larql.kv.spec import (
    BeyondBound,
    MalformedEngineSpec,
    NotAvailableForLiveDecode,
)
from larql.models import Model

# ----------------------------------------------------------------------------- synthetic stores

HIDDEN = 4


def synthetic_store(
    windows: list[list[int]] | None = None,
    entries: list[tuple[int, float, int, int, int]] | None = None,
    residuals: bool = True,
    model: str = "toy",
    hidden: int = HIDDEN,
) -> ApolloStore:
    windows = windows if windows is not None else [[1, 2, 3], [2, 3, 4, 4], [5, 2]]
    rows = entries if entries is not None else [(3, 0.5, 0, 2, 0), (4, 1.0, 1, 2, 1)]
    table = np.array(rows, dtype=ENTRY_DTYPE)
    per_window = max(np.bincount(table["window_id"], minlength=len(windows)), default=0)
    manifest = StoreManifest(
        version=1,
        model=model,
        hidden_size=hidden,
        num_entries=len(table),
        num_windows=len(windows),
        num_tokens=sum(len(w) for w in windows),
        entries_per_window=int(per_window),
        crystal_layer=0,
        window_size=max(len(w) for w in windows),
        arch_config=ArchConfig(
            retrieval_layer=0, query_head=0, injection_layer=0, inject_coefficient=10.0
        ),
        has_residuals=residuals,
    )
    boundaries = None
    if residuals:
        boundaries = np.arange(len(windows) * hidden, dtype=np.float32).reshape(-1, hidden)
    return ApolloStore(
        manifest=manifest,
        window_tokens=[np.asarray(w, dtype=np.uint32) for w in windows],
        entries=table,
        boundaries=boundaries,
    )


def test_store_round_trips_through_its_directory(tmp_path: Path) -> None:
    store = synthetic_store()
    store.boundary_residual = np.full(HIDDEN, 0.25, dtype=np.float32)
    store.save(tmp_path / "s")
    files = sorted(p.relative_to(tmp_path / "s").as_posix() for p in (tmp_path / "s").rglob("*"))
    assert files == [
        "boundaries",
        "boundaries/window_000.npy",
        "boundaries/window_001.npy",
        "boundaries/window_002.npy",
        "boundary_residual.npy",
        "entries.npz",
        "manifest.json",
        "window_token_lists.npz",
    ]
    loaded = ApolloStore.load(tmp_path / "s")
    assert loaded.manifest == store.manifest
    assert [w.tolist() for w in loaded.window_tokens] == [[1, 2, 3], [2, 3, 4, 4], [5, 2]]
    assert all(w.dtype == np.uint32 for w in loaded.window_tokens)
    assert loaded.entries.dtype == ENTRY_DTYPE
    assert loaded.entries.tolist() == store.entries.tolist()
    np.testing.assert_array_equal(loaded.boundaries, store.boundaries)
    np.testing.assert_array_equal(loaded.boundary_residual, store.boundary_residual)
    # boundaries 3×4×4 + residual 4×4 + 9 tokens × 4 + 2 entries × 14 (packed)
    assert ENTRY_DTYPE.itemsize == 14
    assert loaded.total_bytes() == 48 + 16 + 36 + 28
    with np.load(tmp_path / "s" / "window_token_lists.npz") as npz:
        assert sorted(npz.files) == ["0", "1", "2"]
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["arch_config"]["injection_layer"] == 0
    assert manifest["model"] == "toy" and manifest["hidden_size"] == HIDDEN


def test_store_without_residuals_has_no_boundaries(tmp_path: Path) -> None:
    synthetic_store(residuals=False).save(tmp_path / "s")
    loaded = ApolloStore.load(tmp_path / "s")
    assert loaded.boundaries is None and loaded.boundary(0) is None
    assert not (tmp_path / "s" / "boundaries").exists()
    assert loaded.total_bytes() == 36 + 28


def _edit_manifest(**changes: object) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        raw = json.loads((d / "manifest.json").read_text())
        raw.update(changes)
        (d / "manifest.json").write_text(json.dumps(raw))

    return edit


def _save_npz(name: str, **members: np.ndarray) -> Callable[[Path], None]:
    return lambda d: np.savez(d / name, **members)


def _entries_with(**field: int) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        table = np.array([(3, 0.5, 0, 2, 0), (4, 1.0, 1, 2, 1)], dtype=ENTRY_DTYPE)
        for key, value in field.items():
            table[key][1] = value
        np.savez(d / "entries.npz", entries=table)

    return edit


BROKEN_STORES = {
    "no manifest": (lambda d: (d / "manifest.json").unlink(), StoreNotFound, "no manifest"),
    "manifest not json": (
        lambda d: (d / "manifest.json").write_text("{not json"),
        StoreFormatError,
        "not readable JSON",
    ),
    "manifest field missing": (
        lambda d: (d / "manifest.json").write_text(json.dumps({"version": 1})),
        StoreFormatError,
        "has no hidden_size",
    ),
    "manifest field of wrong type": (
        _edit_manifest(num_windows="3"),
        StoreFormatError,
        "num_windows='3' has the wrong type",
    ),
    "unsupported version": (_edit_manifest(version=7), StoreFormatError, "version 7"),
    "num_windows": (
        _edit_manifest(num_windows=2),
        StoreCountMismatch,
        "beyond num_windows=2",
    ),
    "num_tokens": (_edit_manifest(num_tokens=10), StoreCountMismatch, "num_tokens=10"),
    "num_entries": (_edit_manifest(num_entries=3), StoreCountMismatch, "num_entries=3"),
    "entries_per_window": (
        _entries_with(window_id=0),
        StoreCountMismatch,
        "entries_per_window=1",
    ),
    "hidden_size": (_edit_manifest(hidden_size=8), StoreCountMismatch, "hidden_size"),
    "missing boundary": (
        lambda d: (d / "boundaries" / "window_001.npy").unlink(),
        StoreFormatError,
        "window_001.npy is missing",
    ),
    "boundary dtype": (
        lambda d: np.save(d / "boundaries" / "window_002.npy", np.zeros(HIDDEN)),
        StoreFormatError,
        "boundary of window 2: dtype float64",
    ),
    "boundary shape": (
        lambda d: np.save(d / "boundaries" / "window_002.npy", np.zeros(3, np.float32)),
        StoreCountMismatch,
        "differ in shape",
    ),
    "has_residuals of wrong type": (
        _edit_manifest(has_residuals="yes"),
        StoreFormatError,
        "has_residuals='yes'",
    ),
    "boundary residual shape": (
        lambda d: np.save(d / "boundary_residual.npy", np.zeros(HIDDEN + 1, np.float32)),
        StoreCountMismatch,
        "boundary residual has shape (5,)",
    ),
    "corrupt npy": (
        lambda d: (d / "boundaries" / "window_000.npy").write_bytes(b"garbage"),
        StoreFormatError,
        "not a readable .npy",
    ),
    "token lists missing": (
        lambda d: (d / "window_token_lists.npz").unlink(),
        StoreFormatError,
        "window_token_lists.npz is missing",
    ),
    "token list dtype": (
        _save_npz(
            "window_token_lists.npz",
            **{"0": np.array([1, 2, 3]), "1": np.array([2, 3, 4, 4]), "2": np.array([5, 2])},
        ),
        StoreFormatError,
        "window 0 tokens: dtype int64",
    ),
    "token list names": (
        _save_npz("window_token_lists.npz", a=np.zeros(3, np.uint32), b=np.zeros(6, np.uint32)),
        StoreFormatError,
        "members must be named",
    ),
    "token list count": (
        _save_npz("window_token_lists.npz", **{"0": np.zeros(9, np.uint32)}),
        StoreCountMismatch,
        "1 window token lists, manifest says num_windows=3",
    ),
    "corrupt npz": (
        lambda d: (d / "entries.npz").write_bytes(b"PK garbage"),
        StoreFormatError,
        "not a readable .npz",
    ),
    "entries member": (
        _save_npz("entries.npz", rows=np.zeros(2, ENTRY_DTYPE)),
        StoreFormatError,
        "no member 'entries'",
    ),
    "entries dtype": (
        _save_npz("entries.npz", entries=np.zeros(2, np.float32)),
        StoreFormatError,
        "expected a 1-d array",
    ),
    "entry window out of range": (
        _entries_with(window_id=3),
        StoreCountMismatch,
        "entry 1 has window_id 3",
    ),
    "entry position out of range": (
        _entries_with(position_in_window=4),
        StoreCountMismatch,
        "entry 1 has position_in_window 4 but window 1 holds 4 tokens",
    ),
}


@pytest.mark.parametrize("case", BROKEN_STORES, ids=list(BROKEN_STORES))
def test_broken_stores_raise_typed_errors_naming_the_problem(case: str, tmp_path: Path) -> None:
    break_it, error, fragment = BROKEN_STORES[case]
    synthetic_store().save(tmp_path / "s")
    break_it(tmp_path / "s")
    with pytest.raises(error) as raised:
        ApolloStore.load(tmp_path / "s")
    assert isinstance(raised.value, LarqlError)
    assert fragment in str(raised.value)


def test_missing_directory_is_store_not_found(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFound, match="does not exist"):
        ApolloStore.load(tmp_path / "nowhere")


def test_a_store_refuses_another_model() -> None:
    store = synthetic_store(model="toy")
    store.check_model("toy", HIDDEN, 2)
    with pytest.raises(StoreModelMismatch, match="built with toy"):
        store.check_model("other", HIDDEN, 2)
    with pytest.raises(StoreModelMismatch, match=r"hidden 8"):
        store.check_model("toy", 8, 2)
    deep = replace(store.manifest, crystal_layer=5)
    with pytest.raises(StoreModelMismatch, match="crystal_layer 5"):
        replace(store, manifest=deep).check_model("toy", HIDDEN, 5)


# ----------------------------------------------------------------------------- routing

LN_1_6 = 0.470003629245736  # ln((3 − 2 + 0.5)/(2 + 0.5) + 1) = ln 1.6: df 2 of N 3
LN_8_3 = 0.980829253011726  # ln((3 − 1 + 0.5)/(1 + 0.5) + 1) = ln 8/3: df 1 of N 3


def test_idf_matches_the_formula() -> None:
    assert idf(3, 2) == pytest.approx(LN_1_6, abs=1e-12)
    assert idf(3, 1) == pytest.approx(LN_8_3, abs=1e-12)


def test_routing_scores_tf_times_idf_and_skips_tokens_in_every_window() -> None:
    router = WindowRouter([[1, 2, 3], [2, 3, 4, 4], [5, 2]])
    assert router.df(2) == 3 and router.df(3) == 2 and router.df(4) == 1
    scores = router.scores([3, 4, 2])
    # token 2 is in all 3 windows: skipped; 3 (df 2) scores windows 0 and 1; 4 (tf 2) window 1
    assert set(scores) == {0, 1}
    assert scores[0] == pytest.approx(LN_1_6)
    assert scores[1] == pytest.approx(LN_1_6 + 2 * LN_8_3)
    routed = router.resolve([3, 4, 2], 3)
    assert [w for w, _ in routed] == [1, 0]
    assert router.resolve([3, 4, 2], 1) == [(1, pytest.approx(LN_1_6 + 2 * LN_8_3))]
    assert router.resolve([5, 1], 2) == [(0, pytest.approx(LN_8_3)), (2, pytest.approx(LN_8_3))]
    assert router.scores([4, 4])[1] == pytest.approx(4 * LN_8_3)  # each query position counts
    assert router.resolve([2], 3) == [] and router.resolve([99], 3) == []


# ----------------------------------------------------------------------------- entry scoring

# (token, coefficient, window, position, fact)
ENTRIES = np.array(
    [
        (10, 0.5, 0, 0, 0),  # 0: seed (token 10 is in the query)
        (11, 0.9, 0, 5, 1),  # 1: 5 positions from the seed → ×1.3
        (12, 0.4, 0, 30, 0),  # 2: far, but the seed's fact → ×1.3
        (13, 1.0, 0, 40, 2),  # 3: unrelated → backfill ×0.8
        (14, 0.2, 0, 50, 3),  # 4: unrelated, low coefficient
        (15, 1.0, 1, 1, 0),  # 5: another window: never a candidate
        (16, 0.6, 0, 10, 4),  # 6: exactly 10 from the seed → ×1.3
        (17, 0.6, 0, 11, 5),  # 7: 11 from the seed → only backfill
    ],
    dtype=ENTRY_DTYPE,
)


def scored(query: list[int], top_k: int) -> list[tuple[int, float]]:
    return [(e.index, e.score) for e in retrieve_entries(ENTRIES, query, [0], top_k)]


def test_entries_seed_proximity_fact_and_backfill() -> None:
    result = scored([10, 99], top_k=5)
    assert [i for i, _ in result] == [1, 3, 6, 2, 0]
    assert [s for _, s in result] == pytest.approx(
        [0.9 * 1.3, 1.0 * 0.8, 0.6 * 1.3, 0.4 * 1.3, 0.5]
    )


def test_entries_without_backfill_when_neighbours_fill_top_k() -> None:
    result = scored([10], top_k=3)
    assert [i for i, _ in result] == [1, 6, 2]
    assert [s for _, s in result] == pytest.approx([1.17, 0.78, 0.52])


def test_entries_backfill_takes_the_highest_coefficients_first() -> None:
    result = scored([10], top_k=7)
    # seeds + neighbours = 4; backfill 3 (1.0), 7 (0.6), 4 (0.2), all ×0.8; window 1 never
    assert [i for i, _ in result] == [1, 3, 6, 2, 0, 7, 4]
    assert dict(result)[7] == pytest.approx(0.48) and dict(result)[4] == pytest.approx(0.16)


def test_entries_without_seeds_are_the_top_coefficients() -> None:
    result = scored([99], top_k=3)
    assert result == [(3, pytest.approx(1.0)), (1, pytest.approx(0.9)), (6, pytest.approx(0.6))]
    assert {e.index for e in retrieve_entries(ENTRIES, [99], [1], 8)} == {5}


# ----------------------------------------------------------------------------- spec and misses


def test_spec_parameters_and_kind() -> None:
    kind = parse_engine("apollo")
    assert kind.entry.kind == "retrieval" and kind.live_decode is False
    assert dict(kind.params) == {
        "layer": None,
        "coef": 10.0,
        "top_k": 8,
        "store": None,
        "bos": None,
    }
    parsed = parse_engine("apollo:layer=25,coef=8.0,top_k=12")
    assert (parsed.params["layer"], parsed.params["coef"], parsed.params["top_k"]) == (25, 8.0, 12)
    with pytest.raises(NotAvailableForLiveDecode, match="not available for live decode"):
        kind.require_live_decode()
    for bad in ("apollo:coef=abc", "apollo:top_k=0", "apollo:layer=-1", "apollo:coef=nan"):
        with pytest.raises(MalformedEngineSpec):
            parse_engine(bad)


def test_bos_names_the_id_dropped_from_a_query(smollm2: Model, tmp_path: Path) -> None:
    store = build_store(smollm2, CORPUS, BuildOptions(window=32, residuals=False)).save(
        tmp_path / "store"
    )
    marker = smollm2.tokenizer.encode(" Hello")[0]  # not the model's BOS
    query = [marker, *smollm2.tokenizer.encode(QUERY)]
    contexts = {}
    for spec in (f"apollo:store={store}", f"apollo:store={store},bos={marker}"):
        engine = parse_engine(spec).build(smollm2)
        with torch.inference_mode():
            engine.prefill(smollm2, DenseFfn(smollm2), query)
        contexts[spec] = engine._context.tolist()
    kept, dropped = contexts.values()
    assert kept[-len(query) :] == query  # the model's BOS is another id: nothing dropped
    assert dropped[-len(query) + 1 :] == query[1:] and len(dropped) == len(kept) - 1
    assert "bos=" in parse_engine(f"apollo:bos={marker}").build(smollm2).config()
    with pytest.raises(BeyondBound, match=r"bos=10000000 is out of range 0\.\.49151"):
        parse_engine("apollo:bos=10000000").build(smollm2)


def test_without_a_store_prefill_is_a_recoverable_miss(smollm2: Model) -> None:
    engine = parse_engine("apollo").build(smollm2)
    assert isinstance(engine, RetrievalEngine)
    assert "no store attached" in engine.info().description
    with pytest.raises(RetrievalMiss) as raised:
        engine.prefill(smollm2, DenseFfn(smollm2), [1, 2, 3])
    assert raised.value.recoverable is True
    assert raised.value.reason == "apollo store not attached"
    assert str(raised.value) == "retrieval miss: apollo store not attached"


def test_a_query_that_matches_no_window_is_a_recoverable_miss(
    smollm2: Model, tmp_path: Path
) -> None:
    store = synthetic_store(
        windows=[[100, 101], [102, 103]],
        entries=[(101, 1.0, 0, 1, 0)],
        residuals=False,
        model=smollm2.name,
        hidden=smollm2.config.hidden_size,
    )
    store.save(tmp_path / "s")
    engine = parse_engine(f"apollo:store={tmp_path / 's'},layer=3").build(smollm2)
    assert engine.memory_bytes() == store.total_bytes()  # the attached store is held
    with pytest.raises(RetrievalMiss) as raised:
        engine.prefill(smollm2, DenseFfn(smollm2), [5000, 6000])
    assert raised.value.recoverable is True
    assert "no store window matches the query" in raised.value.reason


def test_bad_store_or_layer_fail_at_build(smollm2: Model, tmp_path: Path) -> None:
    with pytest.raises(StoreNotFound):
        parse_engine(f"apollo:store={tmp_path / 'missing'}").build(smollm2)
    toy = tmp_path / "toy"
    synthetic_store().save(toy)
    with pytest.raises(StoreModelMismatch, match="built with toy"):
        parse_engine(f"apollo:store={toy}").build(smollm2)
    real = tmp_path / "real"
    synthetic_store(model=smollm2.name, hidden=smollm2.config.hidden_size).save(real)
    with pytest.raises(BeyondBound, match=r"layer=30 is out of range 0\.\.29"):
        parse_engine(f"apollo:store={real},layer=30").build(smollm2)
    assert parse_engine(f"apollo:store={real},layer=29").build(smollm2).info().config == (
        "inject_layer=29,coef=10.0,top_k=8"
    )


def test_run_refuses_apollo() -> None:
    result = CliRunner().invoke(app, ["run", "hello", "--engine", "apollo"])
    assert result.exit_code == 2
    assert "not available for live decode" in result.output
    assert "Traceback" not in result.output


def build_store_args(corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["apollo", "build-store", "--corpus", str(corpus), "--out", str(out), *extra]


def test_build_store_refuses_a_non_empty_output(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_text("Some text.")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    result = CliRunner().invoke(app, build_store_args(tmp_path / "corpus.txt", tmp_path / "out"))
    assert result.exit_code == 2
    assert "already exists and is not empty" in result.output


# ----------------------------------------------------------------------------- real model

CORPUS = """\
The harbour town of Pellmore sits at the mouth of a slow grey river. Fishing boats leave before \
dawn and return in the late afternoon, and the market on the quay sells what they bring.

In the spring of 1962 the navy began a secret research project on the hill above the town. The \
project was code-named Quibbleflint. Only three engineers in Pellmore knew the name \
Quibbleflint, and they never spoke of it in public.

The lighthouse on the northern cliff was rebuilt in 1890 after a storm destroyed the old tower. \
Its lamp can be seen from twenty miles out to sea, and the keeper's cottage is now a museum.

Every autumn the town holds a festival with music, boat races and a long table of food along \
the harbour wall. Visitors come from the cities inland and fill every guest house for a week.
"""
QUERY = "The secret research project on the hill above Pellmore was code-named"
FACT = " Quibbleflint"


@pytest.fixture(scope="module")
def built_stores(tmp_path_factory: pytest.TempPathFactory, smollm2: Model) -> dict[str, Path]:
    """The corpus as a compressed store built by `larql apollo build-store`, and as an
    uncompressed one built by the same builder in-process (saves a second model load)."""
    root = tmp_path_factory.mktemp("apollo")
    (root / "corpus.txt").write_text(CORPUS)
    out = root / "compressed"
    args = build_store_args(root / "corpus.txt", out, "-m", "smollm2-135m", "--window", "32")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "windows: 6" in result.output and "entries:" in result.output
    assert f"bytes: {ApolloStore.load(out).total_bytes():,}" in result.output
    uncompressed = build_store(smollm2, CORPUS, BuildOptions(window=32, residuals=False))
    return {"compressed": out, "uncompressed": uncompressed.save(root / "uncompressed")}


def fact_logprob(model: Model, store: Path, coef: float) -> tuple[float, Engine]:
    engine = parse_engine(f"apollo:store={store},coef={coef}").build(model)
    hidden = engine.prefill(model, DenseFfn(model), model.tokenizer.encode(QUERY))
    logprobs = torch.log_softmax(final_logits(model, hidden)[0], dim=-1)
    return logprobs[model.tokenizer.encode(FACT)[0]].item(), engine


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["compressed", "uncompressed"])
def test_injection_raises_the_fact_on_the_real_model(
    mode: str, built_stores: dict[str, Path], smollm2: Model
) -> None:
    store = ApolloStore.load(built_stores[mode])
    m = store.manifest
    assert (m.model, m.hidden_size, m.num_windows, m.crystal_layer) == ("smollm2-135m", 576, 6, 15)
    assert m.arch_config.injection_layer == 26 and m.has_residuals == (mode == "compressed")
    fact_ids = smollm2.tokenizer.encode(FACT)
    fact_window = next(
        i for i, w in enumerate(store.window_tokens) if set(fact_ids) <= set(w.tolist())
    )
    without, _ = fact_logprob(smollm2, built_stores[mode], 0.0)
    with_injection, engine = fact_logprob(smollm2, built_stores[mode], 10.0)
    injection = engine.injection
    assert injection.window == fact_window
    assert set(fact_ids) <= set(injection.injected_tokens)
    # measured: compressed −14.39 → −13.80, uncompressed −1.49 → −0.85 nats
    assert with_injection > without + 0.3
    mode_text = "compressed(layer=15)" if mode == "compressed" else "uncompressed"
    assert mode_text in engine.info().description


@pytest.mark.slow
def test_decode_reruns_the_growing_context(built_stores: dict[str, Path], smollm2: Model) -> None:
    engine = parse_engine(f"apollo:store={built_stores['compressed']}").build(smollm2)
    store_bytes = ApolloStore.load(built_stores["compressed"]).total_bytes()
    assert engine.memory_bytes() == store_bytes
    ids = smollm2.tokenizer.encode(QUERY)
    result = generate(engine, smollm2, DenseFfn(smollm2), ids, 4, stop_ids=frozenset())
    assert len(result.tokens) == 4
    memory = engine.memory()
    assert memory.hot == store_bytes + 4 * (len(ids) + 3)  # int32 context: query + 3 decoded
    assert memory.derivative == 2 * 576 * 4  # delta [H] and boundary [1, H], float32
    assert memory.cold == 0 and engine.window_tokens() == 0
    # a decode step is a fresh forward over the longer context (no K/V kept between steps)
    spec = f"apollo:store={built_stores['compressed']},coef=0"
    stepped = parse_engine(spec).build(smollm2)
    stepped.prefill(smollm2, DenseFfn(smollm2), ids)
    step = stepped.decode_step(smollm2, DenseFfn(smollm2), result.tokens[0])
    fresh_engine = parse_engine(spec).build(smollm2)
    fresh = fresh_engine.prefill(smollm2, DenseFfn(smollm2), [*ids, result.tokens[0]])
    assert fresh_engine.injection.window == stepped.injection.window
    torch.testing.assert_close(step, fresh)


@pytest.mark.slow
def test_injection_below_the_crystal_layer_warns_and_injects_nothing(
    built_stores: dict[str, Path], smollm2: Model
) -> None:
    ids = smollm2.tokenizer.encode(QUERY)
    plain = parse_engine(f"apollo:store={built_stores['compressed']},coef=0").build(smollm2)
    expected = plain.prefill(smollm2, DenseFfn(smollm2), ids)
    below = parse_engine(f"apollo:store={built_stores['compressed']},layer=10").build(smollm2)
    with pytest.warns(UserWarning, match="injection layer 10 is below the store's crystal layer"):
        got = below.prefill(smollm2, DenseFfn(smollm2), ids)
    torch.testing.assert_close(got, expected)


@pytest.mark.slow
def test_crystal_zero_boundary_is_virtual_position_zero(smollm2: Model) -> None:
    """With crystal layer 0 the boundary is the embedding of the window's last token, so the
    compressed forward must equal a plain forward over [that token ; query without BOS] with
    the delta added to the last row after the injection layer."""
    store = build_store(smollm2, CORPUS, BuildOptions(window=32, crystal_layer=0))
    engine = ApolloEngine(store, injection_layer=20, model=smollm2)
    bos = smollm2.config.bos_token_id
    query = [bos, *smollm2.tokenizer.encode(QUERY)]
    with torch.inference_mode():
        got = engine.prefill(smollm2, DenseFfn(smollm2), query)  # the FFN is not used
        injection = engine.injection
        last = int(store.window_tokens[injection.window][-1])
        h = embed(smollm2, token_tensor(smollm2, [last, *query[1:]]))

        def add(layer: int, hidden: torch.Tensor) -> torch.Tensor | None:
            if layer == 20:
                hidden = hidden.clone()
                hidden[-1] += injection.delta
                return hidden
            return None

        expected = run_layers(smollm2, DenseFfn(smollm2), h, after_layer=add)[-1:]
    assert injection.delta.abs().sum() > 0
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # delta = Σ embed(token) × coefficient × coef over retrieved tokens not in the query
    rows = embed(smollm2, token_tensor(smollm2, list(injection.injected_tokens)))
    coefficients = torch.tensor(
        [e.coefficient for e in injection.entries if e.token_id in injection.injected_tokens]
    )
    torch.testing.assert_close(injection.delta, (rows * coefficients[:, None]).sum(0) * 10.0)
