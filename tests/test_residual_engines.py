"""The residual-stream engines (markov-rs, markov-rs-codec, boundary-per-layer) as state policies:
exactness vs `standard` at any window, the position walk-through, the bf16 codec, the
codec's KL bound, sufficiency of the residuals (drop the K/V, rebuild, same output), the
precondition check, boundary-per-layer's refusal rules and parity gate, profiling and memory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from helpers import relative_error, teacher_forced
from larql.inference.engine import KvEngine
from larql.inference.errors import BackendUnavailable
from larql.inference.ffn import DenseFfn, FfnBackend
from larql.inference.forward import run_layers
from larql.inference.generation import generate, teacher_forced_logits
from larql.inference.layer import embed, recompute_kv, token_tensor
from larql.kv import parse_engine
from larql.kv.residual import (
    BoundaryPerLayerEngine,
    MarkovResidualCodecEngine,
    MarkovResidualEngine,
    ResidualStreamEngine,
)
from larql.kv.residual.codecs import Bf16Codec, IdentityCodec, bf16_decode, bf16_encode
from larql.kv.residual.policy import (
    BoundaryCalibrationRecord,
    BoundaryLayerPolicy,
    CalibrationBudgetExceeded,
    InMemoryCalibrationStore,
    LayerCountMismatch,
    NoCalibrationRecord,
    PolicyModelMismatch,
    UnsupportedCodec,
)
from larql.kv.residual.store import ResidualStore
from larql.kv.spec import BeyondBound, EngineBuildError, MalformedEngineSpec
from larql.models import Model, load_model
from tiny_models import build_tiny_model, random_ids

PROMPT = "The quick brown fox jumps over the lazy dog because"
LONG_TEXT = (
    PROMPT + " it was tired of running all day long in the hot sun, and the dog had been asleep"
    " under the old oak tree since the early morning, dreaming of bones and rabbits."
)
WINDOWS = [None, 1, 4, 32]
PROMPT_LEN = 30  # of 38 tokens: windows 1 and 4 overflow at prefill, 32 during the decode
LICENSE = Path(__file__).resolve().parents[1] / "LICENSE"


def markov_spec(window: int | None, name: str = "markov-rs") -> str:
    return name if window is None else f"{name}:window={window}"


def residual_engine(spec: str, model: Model | None = None) -> ResidualStreamEngine:
    engine = parse_engine(spec).build(model)
    assert isinstance(engine, ResidualStreamEngine)
    return engine


def kl_per_position(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(softmax(reference) ‖ softmax(other)) per row, nats."""
    log_p = torch.log_softmax(reference.double(), dim=-1)
    log_q = torch.log_softmax(other.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def pre_layer_residuals(model: Model, ids: list[int]) -> list[torch.Tensor]:
    """Oracle: the hidden entering each layer for every position of one full forward, [S, H]."""
    rows: list[torch.Tensor] = []

    def record(_layer: int, h: torch.Tensor) -> None:
        rows.append(h)  # the output of layer ℓ enters layer ℓ + 1

    with torch.inference_mode():
        h0 = embed(model, token_tensor(model, ids))
        run_layers(model, DenseFfn(model), h0, after_layer=record)
    return [h0, *rows[:-1]]


# ---------------------------------------------------------------------------- exactness


@pytest.fixture(scope="module")
def long_ids(smollm2_f64: Model) -> list[int]:
    ids = smollm2_f64.tokenizer.encode(LONG_TEXT)
    assert len(ids) >= 38
    return ids[:38]


@pytest.fixture(scope="module")
def standard_f64(smollm2_f64: Model, long_ids: list[int]) -> torch.Tensor:
    return teacher_forced(smollm2_f64, "standard", long_ids, PROMPT_LEN)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.slow
def test_markov_rs_logits_match_standard_in_float64(
    window: int | None, smollm2_f64: Model, long_ids: list[int], standard_f64: torch.Tensor
) -> None:
    ours = teacher_forced(smollm2_f64, markov_spec(window), long_ids, PROMPT_LEN)
    assert relative_error(ours, standard_f64) <= 1e-9


@pytest.mark.parametrize(
    "window",
    # long: window 4 rebuilds the K/V of the hot rows and the cold ones; without one, hot alone
    [pytest.param(None, marks=pytest.mark.long), 4],
)
@pytest.mark.slow
def test_recompute_mode_is_exact_and_holds_the_residuals_alone(
    window: int | None,
    smollm2_f64: Model,
    long_ids: list[int],
    standard_f64: torch.Tensor,
) -> None:
    """kv_cache=0: every step rebuilds K/V from the stored residuals (hot and cold); the logits
    are standard's and the state is the residuals only."""
    spec = markov_spec(window) + ("," if window else ":") + "kv_cache=0"
    ours = teacher_forced(smollm2_f64, spec, long_ids, PROMPT_LEN)
    assert relative_error(ours, standard_f64) <= 1e-9
    engine = residual_engine(spec, smollm2_f64)
    cached = residual_engine(markov_spec(window), smollm2_f64)
    ffn = DenseFfn(smollm2_f64)
    for e in (engine, cached):
        generate(e, smollm2_f64, ffn, long_ids[:PROMPT_LEN], 4, stop_ids=frozenset())
    cfg = smollm2_f64.config
    rows = PROMPT_LEN + 3  # the last pick is never fed
    memory, with_kv = engine.memory(), cached.memory()
    assert memory.derivative == 0 and with_kv.derivative > 0
    assert memory.hot + memory.cold == cfg.num_layers * rows * cfg.hidden_size * 8  # float64
    assert memory.hot + memory.cold == with_kv.hot + with_kv.cold
    assert "kv_cache=0" in engine.info().config


@pytest.mark.slow
def test_markov_rs_greedy_tokens_match_standard_in_float32(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(PROMPT)
    ffn = DenseFfn(smollm2)

    def tokens(spec: str) -> list[int]:
        engine = parse_engine(spec).build(smollm2)
        return generate(engine, smollm2, ffn, ids, 16, stop_ids=frozenset()).tokens

    reference = tokens("standard")
    assert len(reference) == 16 and len(ids) == 10
    # window 1 overflows at prefill, 12 during the decode (no window and window 4:
    # test_engine_compliance's greedy test)
    for window in (1, 12):
        assert tokens(markov_spec(window)) == reference, window


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Model:
    """gemma3 has sliding layers (window 6) narrower than the prompts below."""
    pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp(f"residual-{request.param}")
    build_tiny_model(request.param, directory)
    return load_model(str(directory), dtype=torch.float64)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.slow
def test_markov_rs_exact_on_tiny_architectures(window: int | None, tiny: Model) -> None:
    ids = random_ids(44, seed=3)
    reference = teacher_forced(tiny, "standard", ids, 10)
    ours = teacher_forced(tiny, markov_spec(window), ids, 10)
    assert relative_error(ours, reference) <= 1e-9


def test_every_engine_honours_the_ffn_backend(tiny: Model) -> None:
    class OddLayersAblated(FfnBackend):
        name = "odd-layers-ablated"

        def __init__(self) -> None:
            self.dense = DenseFfn(tiny)

        def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
            out = self.dense.forward(layer, x)
            return torch.zeros_like(out) if layer % 2 else out

    ids = random_ids(16, seed=5)
    ffn = OddLayersAblated()
    reference = teacher_forced_logits(parse_engine("standard").build(tiny), tiny, ffn, ids, 6)
    for spec in ("markov-rs:window=3", "boundary-per-layer"):
        ours = teacher_forced_logits(parse_engine(spec).build(tiny), tiny, ffn, ids, 6)
        assert relative_error(ours, reference) <= 1e-9, spec
    dense = teacher_forced(tiny, "standard", ids, 6)
    assert relative_error(dense, reference) > 1e-3  # the ablation really changes the output


# ---------------------------------------------------------------------------- positions


def test_appendix_c_position_walk_through(smollm2_f64: Model) -> None:
    """markov-rs:window=3, prompt of 5: hot/cold rows and their positions after every step, the
    stored rows equal to the oracle's pre-layer residuals at those positions, and K/V row p
    equal to recompute_kv of position p's residual at position p."""
    model, ffn = smollm2_f64, DenseFfn(smollm2_f64)
    ids = model.tokenizer.encode(PROMPT)[:8]
    oracle = pre_layer_residuals(model, ids)
    engine = residual_engine("markov-rs:window=3", model)
    expected = {  # tokens seen → (cold positions, hot positions)
        5: (range(0, 2), range(2, 5)),
        6: (range(0, 3), range(3, 6)),
        7: (range(0, 4), range(4, 7)),
        8: (range(0, 5), range(5, 8)),
    }
    with torch.inference_mode():
        engine.prefill(model, ffn, ids[:5])
        for seen in range(5, 9):
            if seen > 5:
                engine.decode_step(model, ffn, ids[seen - 1])
            store = engine.store
            cold, hot = expected[seen]
            assert (store.cold_positions(), store.hot_positions()) == (cold, hot)
            assert store.next_position == seen
            assert engine.window_tokens() == 3
            for layer in (0, 13, model.config.num_layers - 1):
                stored_hot = store.hot_rows(layer)
                stored_cold = store.cold_rows(layer)
                assert relative_error(stored_hot, oracle[layer][hot.start : hot.stop]) <= 1e-12
                assert relative_error(stored_cold, oracle[layer][: cold.stop]) <= 1e-12
                assert store.kv is not None and len(store.kv[layer]) == seen
                k, v = recompute_kv(model, layer, oracle[layer][:seen], 0)
                assert relative_error(store.kv[layer].keys, k) <= 1e-9
                assert relative_error(store.kv[layer].values, v) <= 1e-9


def test_codec_cold_kv_uses_round_tripped_rows_at_true_positions(smollm2_f64: Model) -> None:
    model, ffn = smollm2_f64, DenseFfn(smollm2_f64)
    ids = model.tokenizer.encode(PROMPT)[:8]
    engine = residual_engine("markov-rs-codec:window=3", model)
    with torch.inference_mode():
        engine.prefill(model, ffn, ids[:6])  # prefill overflow: positions 0..2 go cold
        engine.decode_step(model, ffn, ids[6])  # decode overflow: position 3 goes cold
        store = engine.store
        assert store.cold_positions() == range(0, 4)
        for layer in (0, model.config.num_layers - 1):
            cold = store.cold_rows(layer).contiguous()  # [4, H], round-tripped
            k, v = recompute_kv(model, layer, cold, 0)
            assert store.kv is not None
            assert relative_error(store.kv[layer].keys[:, :4], k) <= 1e-12
            assert relative_error(store.kv[layer].values[:, :4], v) <= 1e-12
            hot = store.hot_rows(layer).contiguous()
            k_hot, _ = recompute_kv(model, layer, hot, 4)
            assert relative_error(store.kv[layer].keys[:, 4:], k_hot) <= 1e-9


# ---------------------------------------------------------------------------- the codec


def test_bf16_encoding_is_round_to_nearest_even() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-20, 20, 4096)
    bits = x.view(torch.int32)
    ties = ((bits & ~0xFFFF) | 0x8000).view(torch.float32)  # exactly halfway: even wins
    values = torch.cat([x, ties, torch.tensor([0.0, -0.0, 1.0, -3.5, 65504.0])])
    encoded = bf16_encode(values)
    assert encoded.dtype == torch.uint16
    assert torch.equal(bf16_decode(encoded), values.to(torch.bfloat16).float())
    assert torch.equal(bf16_decode(bf16_encode(bf16_decode(encoded))), bf16_decode(encoded))
    rel = ((bf16_decode(encoded) - values).abs() / values.abs().clamp_min(1e-30)).max()
    assert rel.item() <= 2.0**-8
    # the bit-pattern formula, on every finite value
    u32 = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    formula = (((u32 + 0x7FFF + ((u32 >> 16) & 1)) & 0xFFFFFFFF) >> 16).to(torch.int32)
    assert torch.equal(encoded.to(torch.int32) & 0xFFFF, formula)
    special = bf16_decode(bf16_encode(torch.tensor([float("inf"), -float("inf"), float("nan")])))
    assert special[0] == float("inf") and special[1] == -float("inf") and special[2].isnan()


def test_codecs_store_what_they_say() -> None:
    rows = torch.randn(5, 8, dtype=torch.float64)
    identity, bf16 = IdentityCodec(), Bf16Codec()
    assert identity.append(rows) is rows and torch.equal(identity.decode(), rows)
    back = bf16.append(rows)
    assert back.dtype == torch.float64 and torch.equal(bf16.decode(), back)
    assert 0 < relative_error(back, rows) <= 2.0**-8
    bf16.append(rows[:2])
    assert len(bf16) == 7 and bf16.decode().shape == (7, 8)


def test_bf16_codec_stores_bf16_rows_bit_for_bit() -> None:
    rows = torch.randn(5, 8).to(torch.bfloat16)
    codec = Bf16Codec()
    back = codec.append(rows)
    assert back.dtype == torch.bfloat16 and torch.equal(back, rows)
    assert torch.equal(codec.decode(), rows) and codec.nbytes() >= 5 * 8 * 2
    assert codec.lossless_for(torch.bfloat16)
    assert not codec.lossless_for(torch.float32) and not codec.lossless_for(torch.float16)
    assert IdentityCodec().lossless_for(torch.float32)


@pytest.mark.slow
def test_codec_equals_markov_rs_in_a_bf16_model(smollm2: Model) -> None:
    """In a bfloat16 model the bf16 cold tier loses nothing, so the codec engine keeps the K/V it
    computed (no recompute) and decodes exactly as markov-rs at the same window."""
    model = smollm2.to(dtype=torch.bfloat16)
    ids = model.tokenizer.encode(LONG_TEXT)[:18]  # 8 steps after a prompt of 10, window 4
    ffn = DenseFfn(model)
    outputs = []
    for name in ("markov-rs", "markov-rs-codec"):
        engine = parse_engine(markov_spec(4, name)).build(model, profiling=True)
        outputs.append(teacher_forced_logits(engine, model, ffn, ids, 10))
        summary = engine.stage_summary()
        assert engine.cold_bytes() > 0 and summary is not None
        assert summary.avg_recompute_cold_us == 0  # every step evicted a row; none recomputed
    assert torch.equal(outputs[0], outputs[1])
    lossy = parse_engine(markov_spec(4, "markov-rs-codec")).build(smollm2, profiling=True)
    teacher_forced_logits(lossy, smollm2, DenseFfn(smollm2), ids, 10)
    summary = lossy.stage_summary()
    assert summary is not None and summary.avg_recompute_cold_us > 0  # float32: recomputed


@pytest.mark.parametrize(
    "window",
    # long: window 64, never reached, runs the same path as no window, with the window set
    [pytest.param(None, marks=pytest.mark.long), 64],
)
@pytest.mark.slow
def test_codec_is_bit_identical_to_markov_rs_without_overflow(
    window: int | None, smollm2: Model
) -> None:
    ids = smollm2.tokenizer.encode(LONG_TEXT)[:16]
    ffn = DenseFfn(smollm2)
    outputs = []
    for name in ("markov-rs", "markov-rs-codec"):
        engine = parse_engine(markov_spec(window, name)).build(smollm2)
        outputs.append(teacher_forced_logits(engine, smollm2, ffn, ids, 8))
        assert engine.cold_bytes() == 0
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.slow
def test_codec_mean_kl_vs_standard_over_64_positions(smollm2: Model) -> None:
    """The contract with overflow: mean KL(standard ‖ codec) ≤ 0.01 nats over 64 teacher-forced
    positions of natural text (measured ≈1e-5 at window 4 over 128; benchmarks/codec_kl.py)."""
    ids = smollm2.tokenizer.encode(LICENSE.read_text())[: 32 + 63]
    standard = teacher_forced(smollm2, "standard", ids, 32)
    codec = teacher_forced(smollm2, "markov-rs-codec:window=4", ids, 32)
    assert standard.shape[0] == 64
    kl = kl_per_position(standard, codec)
    assert 0 < kl.mean().item() <= 0.01  # > 0: the cold tier really was rounded
    assert (codec.argmax(-1) == standard.argmax(-1)).double().mean().item() >= 0.95


# ---------------------------------------------------------------------------- sufficiency


@pytest.mark.parametrize(
    "spec",
    [
        # long: markov-rs:window=4 rebuilds the same tier's K/V, of hot rows and cold ones
        pytest.param("markov-rs", marks=pytest.mark.long),
        "markov-rs:window=4",
        "markov-rs-codec:window=4",
        "boundary-per-layer:window=2",
    ],
)
@pytest.mark.slow
def test_dropped_kv_is_rebuilt_from_residuals(spec: str, smollm2_f64: Model) -> None:
    """The residuals are a sufficient state: forget every K/V mid-run and the outputs stay."""
    model, ffn = smollm2_f64, DenseFfn(smollm2_f64)
    ids = model.tokenizer.encode(LONG_TEXT)[:11]
    kept, dropped = residual_engine(spec, model), residual_engine(spec, model)
    with torch.inference_mode():
        kept.prefill(model, ffn, ids[:6])
        dropped.prefill(model, ffn, ids[:6])
        for i, token in enumerate(ids[6:]):
            if i in (0, 3):
                dropped.drop_derivative()
                assert dropped.memory().derivative == 0
            a = kept.decode_step(model, ffn, token)
            b = dropped.decode_step(model, ffn, token)
            assert relative_error(b, a) <= 1e-9
            assert dropped.memory().derivative > 0


# ---------------------------------------------------------------------------- preconditions


@pytest.fixture(scope="module")
def insufficient(smollm2: Model) -> Model:
    arch = dataclasses.replace(smollm2.config.arch, residual_is_sufficient=False)
    return dataclasses.replace(smollm2, config=dataclasses.replace(smollm2.config, arch=arch))


@pytest.mark.parametrize("spec", ["markov-rs", "markov-rs-codec:window=2", "boundary-per-layer"])
def test_precondition_refuses_insufficient_architecture(spec: str, insufficient: Model) -> None:
    with pytest.raises(BackendUnavailable, match="pre-layer residual"):
        parse_engine(spec).build(insufficient)
    engine = parse_engine(spec).build(None)  # model unknown at build: refused at prefill
    with pytest.raises(BackendUnavailable):
        engine.prefill(insufficient, DenseFfn(insufficient), [1, 2, 3])
    assert engine.memory_bytes() == 0


# ---------------------------------------------------------------------------- boundary-per-layer


def test_boundary_per_layer_policy_defaults_to_model_depth(smollm2: Model) -> None:
    engine = residual_engine("boundary-per-layer", smollm2)
    assert isinstance(engine, BoundaryPerLayerEngine)
    depth = smollm2.config.num_layers
    assert engine.policy is not None and len(engine.policy.entries) == depth
    expected = "smollm2-135m|" + ",".join(f"{i}=bf16" for i in range(depth))
    assert engine.fingerprint() == expected
    assert engine.calibration_record == BoundaryCalibrationRecord(expected, "bf16-trivial", 0.01, 0)
    info = engine.info()
    assert info.config == f"window=full,layers={depth}"
    assert info.description.startswith("per-layer codec policy on cold tier (kl_bound=0.010 nats")
    assert residual_engine("boundary-pl:window=7,layers=30", smollm2).info().config == (
        "window=7,layers=30"
    )


def test_boundary_per_layer_refusals_are_typed(smollm2: Model) -> None:
    depth = smollm2.config.num_layers
    with pytest.raises(BeyondBound, match=f"more than the model's {depth} layers"):
        parse_engine("boundary-per-layer:layers=34").build(smollm2)
    # built without a model: the same typed error at prefill, nothing held
    engine = parse_engine("boundary_per_layer:layers=34").build(None)
    with pytest.raises(LayerCountMismatch):
        engine.prefill(smollm2, DenseFfn(smollm2), [1, 2, 3])
    assert engine.memory_bytes() == 0

    uniform = BoundaryLayerPolicy.uniform("smollm2-135m", depth)
    odd = BoundaryLayerPolicy("smollm2-135m", (*uniform.entries[:-1], "int8"))
    with pytest.raises(UnsupportedCodec, match="layer 29 asks for codec 'int8'"):
        BoundaryPerLayerEngine(model=smollm2, policy=odd)
    with pytest.raises(PolicyModelMismatch):
        BoundaryPerLayerEngine(model=smollm2, policy=BoundaryLayerPolicy.uniform("other", depth))
    with pytest.raises(NoCalibrationRecord, match="no calibration record") as no_record:
        BoundaryPerLayerEngine(model=smollm2, calibration=InMemoryCalibrationStore())
    assert isinstance(no_record.value, EngineBuildError)
    loose = BoundaryCalibrationRecord(uniform.fingerprint(), "wiki-100", 0.05, 400)
    with pytest.raises(CalibrationBudgetExceeded):
        BoundaryPerLayerEngine(model=smollm2, calibration=InMemoryCalibrationStore([loose]))
    tight = BoundaryCalibrationRecord(uniform.fingerprint(), "wiki-100", 0.004, 400)
    engine = BoundaryPerLayerEngine(model=smollm2, calibration=InMemoryCalibrationStore([tight]))
    assert engine.calibration_record == tight
    assert "kl_bound=0.004 nats" in engine.info().description


@pytest.mark.parametrize(
    "window",
    # long: without a window no row goes cold, so neither engine's codec codes a row
    [pytest.param(None, marks=pytest.mark.long), 8],
)
@pytest.mark.slow
def test_boundary_per_layer_parity_gate_vs_codec(window: int | None, smollm2: Model) -> None:
    """First greedy divergence from markov-rs-codec at the same window not before step 5 (over
    50 steps measured: no divergence, 50/50, unbounded and at window 8; 24 here)."""
    ids = smollm2.tokenizer.encode(PROMPT)
    ffn = DenseFfn(smollm2)
    runs = []
    for name in ("markov-rs-codec", "boundary-per-layer"):
        engine = parse_engine(markov_spec(window, name)).build(smollm2)
        runs.append(generate(engine, smollm2, ffn, ids, 24, stop_ids=frozenset()).tokens)
    codec, per_layer = runs
    assert len(codec) == 24
    divergence = next(
        (i for i, (a, b) in enumerate(zip(codec, per_layer, strict=True)) if a != b), 24
    )
    assert divergence >= 5
    assert per_layer == codec  # measured agreement: identical streams


# ---------------------------------------------------------------------------- profiling, memory


@pytest.mark.parametrize(
    "spec", ["markov-rs:window=3", "markov-rs-codec:window=3", "boundary-per-layer:window=3"]
)
def test_profiling_does_not_change_outputs(spec: str, tiny: Model) -> None:
    ids = random_ids(14, seed=9)
    outputs, summaries = [], []
    for profiling in (False, True):
        engine = parse_engine(spec).build(tiny, profiling=profiling)
        rows = []
        with torch.inference_mode():
            rows.append(engine.prefill(tiny, DenseFfn(tiny), ids[:5]))
            for i, token in enumerate(ids[5:]):
                if i == 4:
                    engine.drop_derivative()  # type: ignore[attr-defined]
                rows.append(engine.decode_step(tiny, DenseFfn(tiny), token))
        outputs.append(torch.cat(rows))
        summaries.append(engine.stage_summary())
    assert torch.equal(outputs[0], outputs[1])
    assert summaries[0] is None
    summary = summaries[1]
    assert summary is not None and summary.steps == len(ids) - 5
    assert summary.avg_embed_us > 0 and summary.avg_attention_us > 0 and summary.avg_ffn_us > 0
    assert summary.avg_state_append_us > 0 and summary.avg_recompute_total_us() > 0
    assert summary.avg_total_decode_us >= summary.avg_attention_us + summary.avg_ffn_us


@pytest.mark.slow
def test_memory_is_counted_from_the_tensors_held(smollm2: Model) -> None:
    model, ffn = smollm2, DenseFfn(smollm2)
    layers, hidden, kv_dim = model.config.num_layers, model.config.hidden_size, model.config.kv_dim
    ids = model.tokenizer.encode(LONG_TEXT)[:16]
    engines: dict[str, KvEngine] = {}
    for spec in ("markov-rs:window=4", "markov-rs-codec:window=4", "boundary-per-layer:window=4"):
        engine = residual_engine(spec, model)
        assert engine.memory().total == 0
        with torch.inference_mode():
            engine.prefill(model, ffn, ids[:12])
            for token in ids[12:]:
                engine.decode_step(model, ffn, token)
        store = engine.store
        memory = engine.memory()
        assert memory.hot == store.hot.live_nbytes()
        assert memory.hot == layers * 4 * hidden * 4  # 4 hot rows of float32 per layer
        assert store.kv is not None
        assert memory.derivative == sum(b.live_nbytes() for b in store.kv)
        storages = [store.hot, *(tier.codec for tier in store.cold), *store.kv]
        held = sum(s.nbytes() for s in storages)
        assert memory.total == held == memory.state + memory.reserved
        assert memory.derivative == layers * 2 * len(ids) * kv_dim * 4
        assert engine.window_tokens() == 4 and store.cold_len == len(ids) - 4
        assert engine.cold_bytes() == memory.cold > 0
        assert memory.total == engine.memory_bytes()
        engines[spec] = engine
    identity = engines["markov-rs:window=4"].memory().cold
    assert engines["markov-rs-codec:window=4"].memory().cold * 2 == identity  # bf16 vs float32
    assert engines["boundary-per-layer:window=4"].memory().cold * 2 == identity
    assert engines["markov-rs:window=4"].info().config == "window=4"
    assert engines["markov-rs-codec:window=4"].info().config == "window=4,codec=bf16"
    assert engines["boundary-per-layer:window=4"].info().config == "window=4,layers=30"
    for engine in engines.values():
        assert engine.memory().brief() in engine.info().description  # state + reserve in MiB


@pytest.mark.slow
def test_hot_tier_storage_stays_bounded_over_a_long_decode(tiny: Model) -> None:
    """Amortised O(1) per step: the hot tier's allocation does not grow with the context."""
    engine = residual_engine("markov-rs-codec:window=4", tiny)
    ffn = DenseFfn(tiny)
    ids = random_ids(200, seed=11)
    with torch.inference_mode():
        engine.prefill(tiny, ffn, ids[:50])
        sizes = []
        for token in ids[50:]:
            engine.decode_step(tiny, ffn, token)
            sizes.append(engine.memory().hot)
    assert max(sizes[50:]) == max(sizes[:50])  # hot allocation is flat once warmed up
    assert engine.store.cold_len == 196


# ---------------------------------------------------------------------------- specs


@pytest.mark.parametrize(
    ("alias", "canonical", "engine_type"),
    [
        ("markov_rs", "markov-rs", MarkovResidualEngine),
        ("markov-residual", "markov-rs", MarkovResidualEngine),
        ("MARKOV_RESIDUAL:window=8", "markov-rs", MarkovResidualEngine),
        ("markov_rs_codec", "markov-rs-codec", MarkovResidualCodecEngine),
        ("markov-residual-codec:window=2", "markov-rs-codec", MarkovResidualCodecEngine),
        ("markov_residual_codec", "markov-rs-codec", MarkovResidualCodecEngine),
        ("boundary_per_layer", "boundary-per-layer", BoundaryPerLayerEngine),
        ("boundary-pl:window=3,layers=30", "boundary-per-layer", BoundaryPerLayerEngine),
    ],
)
def test_aliases_build_the_canonical_engine(
    alias: str, canonical: str, engine_type: type, smollm2: Model
) -> None:
    kind = parse_engine(alias)
    assert kind.display_name == canonical
    assert parse_engine(kind.spec()) == kind
    assert isinstance(kind.build(smollm2), engine_type)


@pytest.mark.parametrize(
    "spec",
    [
        "markov-rs:window=0",
        "markov-rs:window=abc",
        "markov-rs-codec:bits=4",
        "boundary-pl:layers=0",
    ],
)
def test_malformed_specs_are_refused(spec: str) -> None:
    with pytest.raises(MalformedEngineSpec, match="supported"):
        parse_engine(spec)


def test_a_lossless_tier_extends_a_prefill_as_one_longer_prefill(smollm2: Model) -> None:
    """markov-rs's prompt in three chunks (the window overflowing on the way) against the whole
    prompt at once, layer by layer on float weights: the same stored rows and K/V and the same
    last hidden row up to the order of float sums. A lossy tier refuses to extend."""
    model, ffn = smollm2, DenseFfn(smollm2)
    ids = model.tokenizer.encode(LONG_TEXT)[:23]
    whole = residual_engine("markov-rs:window=8", model)
    chunked = residual_engine("markov-rs:window=8", model)
    assert chunked.extends_exactly(model)
    with torch.inference_mode():
        expected = whole.prefill_all(model, ffn, ids)
        chunked.prefill(model, ffn, ids[:10])
        chunked.extend(model, ffn, ids[10:17])
        last = chunked.extend(model, ffn, ids[17:])
    assert chunked.position == whole.position == 23
    assert relative_error(last, expected[-1:]) <= 1e-5
    mine, theirs = chunked.store, whole.store
    assert (mine.hot_len, mine.cold_len) == (theirs.hot_len, theirs.cold_len) == (8, 15)
    assert relative_error(mine.hot.rows, theirs.hot.rows) <= 1e-5
    for layer in (0, 29):
        assert relative_error(mine.kv[layer].keys, theirs.kv[layer].keys) <= 1e-5
    codec = residual_engine("markov-rs-codec:window=8", model)
    assert not codec.extends_exactly(model)
    with torch.inference_mode():
        codec.prefill(model, ffn, ids[:10])
        with pytest.raises(BackendUnavailable, match="lossless cold tier"):
            codec.extend(model, ffn, ids[10:])


@pytest.mark.parametrize("spec", ["markov-rs-codec", "boundary-per-layer"])
def test_a_lossy_tier_no_row_reaches_extends_a_prefill(smollm2: Model, spec: str) -> None:
    """Without a window no row goes cold, so a bf16 tier on a float32 model codes nothing and
    a prompt in chunks gives the rows and K/V of the whole prompt at once."""
    model, ffn = smollm2, DenseFfn(smollm2)
    ids = model.tokenizer.encode(LONG_TEXT)[:23]
    whole, chunked = residual_engine(spec, model), residual_engine(spec, model)
    assert chunked.extends_exactly(model)
    assert not residual_engine(f"{spec}:window=8", model).extends_exactly(model)
    with torch.inference_mode():
        expected = whole.prefill_all(model, ffn, ids)
        chunked.prefill(model, ffn, ids[:10])
        last = chunked.extend(model, ffn, ids[10:])
    assert relative_error(last, expected[-1:]) <= 1e-5
    assert chunked.store.cold_len == 0 and chunked.store.hot_len == 23
    assert relative_error(chunked.store.hot.rows, whole.store.hot.rows) <= 1e-5
    for layer in (0, 29):
        assert relative_error(chunked.store.kv[layer].keys, whole.store.kv[layer].keys) <= 1e-5


def test_a_store_of_two_codecs_keeps_each_layers_rows_in_its_tier() -> None:
    """Layers 0 and 2 lossless, 1 and 3 in bf16, layer 4 holding nothing (it shares K/V): one
    position's rows of every layer go in and out together; each layer's cold rows come back
    from its own tier, and only the bf16 layers' evicted rows are handed back for new K/V."""
    g = torch.Generator().manual_seed(0)
    labels = ["identity", "bf16", "identity", "bf16", "identity"]
    store = ResidualStore(2, labels, keeps_kv=[True, True, True, True, False])
    assert [t.label for t in store.cold] == ["identity", "bf16"]
    rows = torch.randn(5, 5, 3, 8, generator=g)  # [positions, layers, S=3 rows, H]
    evicted = []
    for position in range(5):
        for layer in range(5):
            store.push(layer, rows[position, layer])
        store.advance(3)
        evicted.append(store.evict_overflow())
    assert evicted[0] is not None and evicted[0].first_position == 0
    assert evicted[0].layers == [1, 3] and evicted[0].stored.shape == (1, 2, 8)
    every = rows.permute(0, 2, 1, 3).reshape(15, 5, 8)  # [positions, layers, H]
    assert store.hot_len == 2 and store.cold_len == 13
    for layer in (0, 2):
        assert torch.equal(store.cold_rows(layer), every[:13, layer])
    for layer in (1, 3):
        assert torch.equal(store.cold_rows(layer), every[:13, layer].bfloat16().float())
    assert torch.equal(store.hot_rows(3), every[13:, 3])
    with pytest.raises(IndexError, match="layer 4 holds no"):
        store.cold_rows(4)
