"""Every engine of the catalog against the engine protocol: empty state before prefill, typed
errors for misuse, non-empty descriptions, and — for the engines whose contract is exact —
agreement with `standard` on the real default model and on tiny random architectures
(docs/DESIGN.md, decision 1). New engines are picked up from the catalog automatically."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import teacher_forced
from larql.inference.errors import EmptyPrompt, EngineError, InvariantViolation
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate
from larql.inference.layer import final_logits
from larql.kv import CATALOG, parse_engine
from larql.kv.composed.spec import composable
from larql.models import Model, load_model
from tiny_models import build_tiny_model, random_ids

# Every composition the catalog allows (EVICTION+QUANTISER, defaults), and one that evicts.
_EVICTIONS, _QUANTISERS = composable(CATALOG.entries)
COMPOSED_SPECS = [f"{e}+{q}" for e in _EVICTIONS for q in _QUANTISERS] + [
    "snapkv:budget=4,window=2+turbo-quant:bits=3"
]
# One spec per engine with its default parameters, and the compositions.
ALL_SPECS = [entry.name for entry in CATALOG.entries] + COMPOSED_SPECS
LIVE_SPECS = [e.name for e in CATALOG.entries if e.live_decode] + COMPOSED_SPECS

# Specs whose contract is exact vs standard for a prompt shorter than 64 tokens and ≤ 32 steps
# (windowed engines at windows that overflow where the contract still holds).
EXACT_SPECS = [
    "no-cache",
    "markov-rs",
    "markov-rs:window=4",
    "markov-rs:kv_cache=0",
    "markov-rs-codec",
    "boundary-kv:chunk_tokens=4",
    "boundary-per-layer",
    "windowed-checkpoint:window=128",
    "semantic-promotion",
    "semantic-promotion:base=markov-rs:window=4",
]
PROMPT = "Alice put the red ball in the box, and Bob"


def registered(spec: str) -> bool:
    return CATALOG.parses(spec)


def exact_specs() -> list[str]:
    return [s for s in EXACT_SPECS if registered(s)]


# Each exact spec is checked on the real model in `make test` once: by its float64 logits, or
# (where it holds more steps: the windowed specs past their window, and no-cache, whose float64
# run is the slowest) by its GREEDY_STEPS greedy float32 tokens (markov-rs:window=4 is past its
# window from the first step). The other check of each is `long`.
GREEDY_IN_MAKE_TEST = {"no-cache", "markov-rs:window=4", "windowed-checkpoint:window=128"}
GREEDY_STEPS = 16


def exact_cases(greedy: bool) -> list:
    return [
        pytest.param(s, marks=() if (s in GREEDY_IN_MAKE_TEST) == greedy else pytest.mark.long)
        for s in exact_specs()
    ]


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_nothing_held_before_prefill(spec: str, smollm2: Model) -> None:
    engine = parse_engine(spec).build(smollm2)
    assert engine.memory_bytes() == 0
    assert engine.memory().total == 0
    assert engine.window_tokens() == 0
    assert engine.cold_bytes() == 0
    assert engine.stage_summary() is None


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_decode_before_prefill_is_an_invariant_violation(spec: str, smollm2: Model) -> None:
    engine = parse_engine(spec).build(smollm2)
    with pytest.raises(InvariantViolation) as raised:
        engine.decode_step(smollm2, DenseFfn(smollm2), 42)
    assert raised.value.recoverable is False


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_empty_prompt_is_typed(spec: str, smollm2: Model) -> None:
    engine = parse_engine(spec).build(smollm2)
    with pytest.raises(EmptyPrompt) as raised:
        engine.prefill(smollm2, DenseFfn(smollm2), [])
    assert raised.value.recoverable is True
    assert str(raised.value) == "engine called with empty prompt"


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_info_is_complete(spec: str, smollm2: Model) -> None:
    kind = parse_engine(spec)
    engine = kind.build(smollm2)
    info = engine.info()
    assert info.name == kind.display_name == engine.name
    assert info.backend and info.description
    assert info.name in info.summary()


# float64 on the real model for one engine of each kind; the rest of the float64 runs are
# `long`: every live engine runs in float32 here, and in float64 on the tiny llama and
# gemma4_global models below (the exact ones on the real model in float64 too)
F64_DECODE_SPECS = {
    "standard",
    "turbo-quant",
    "kv-quant",
    "snapkv",
    "snapkv:budget=4,window=2+turbo-quant:bits=3",
}
# float32 on the real model: `long` where another test of `make test` decodes the same engine
# on it in float32 — test_eviction_scorers each scorer and h2o, test_composed snapkv, h2o, tova
# and kvzip with a quantiser, the greedy checks below standard, no-cache, markov-rs and
# windowed-checkpoint. The compositions of keydiff and expected-attention, and the evicting
# one, stand for the compositions here.
F32_DECODED_ELSEWHERE = (
    {"standard", "no-cache", "markov-rs", "windowed-checkpoint"}
    | {"h2o", "tova", "keydiff", "expected-attention", "kvzip"}
    | {f"{e}+{q}" for e in ("snapkv", "h2o", "tova", "kvzip") for q in _QUANTISERS}
    | {"keydiff+turbo-quant", "expected-attention+kv-quant"}
)


def _dtype_case_runs(dtype: torch.dtype, spec: str) -> bool:
    if dtype == torch.float32:
        return spec not in F32_DECODED_ELSEWHERE
    return spec in F64_DECODE_SPECS


DTYPE_CASES = [
    pytest.param(
        dtype,
        spec,
        id=f"dtype{i}-{spec}",
        marks=() if _dtype_case_runs(dtype, spec) else pytest.mark.long,
    )
    for i, dtype in enumerate((torch.float32, torch.float64))
    for spec in LIVE_SPECS
]


@pytest.mark.parametrize(("dtype", "spec"), DTYPE_CASES)
def test_live_engines_decode_in_both_cpu_dtypes(
    spec: str, dtype: torch.dtype, smollm2: Model, smollm2_f64: Model
) -> None:
    model = smollm2 if dtype == torch.float32 else smollm2_f64
    engine = parse_engine(spec).build(model)
    ids = model.tokenizer.encode(PROMPT)
    result = generate(engine, model, DenseFfn(model), ids, 4, stop_ids=frozenset())
    assert len(result.tokens) == 4
    assert engine.memory_bytes() > 0


F64_TEXT = PROMPT + " took it out again"  # 8 prompt tokens, 7 steps: boundary-kv's 4-token
# chunks end in the prompt and in the steps


@pytest.fixture(scope="module")
def standard_f64_logits(smollm2_f64: Model) -> torch.Tensor:
    return teacher_forced(smollm2_f64, "standard", smollm2_f64.tokenizer.encode(F64_TEXT), 8)


@pytest.mark.parametrize("spec", exact_cases(greedy=False))
@pytest.mark.slow
def test_exact_engine_logits_match_standard_in_float64(
    spec: str, smollm2_f64: Model, standard_f64_logits: torch.Tensor
) -> None:
    ours = teacher_forced(smollm2_f64, spec, smollm2_f64.tokenizer.encode(F64_TEXT), 8)
    reference = standard_f64_logits
    assert ((ours - reference).abs().max() / reference.abs().max()).item() <= 1e-9


def _greedy_tokens(model: Model, spec: str) -> list[int]:
    engine = parse_engine(spec).build(model)
    ids = model.tokenizer.encode(PROMPT)
    return generate(engine, model, DenseFfn(model), ids, GREEDY_STEPS, stop_ids=frozenset()).tokens


@pytest.fixture(scope="module")
def standard_greedy_tokens(smollm2: Model) -> list[int]:
    return _greedy_tokens(smollm2, "standard")


@pytest.mark.parametrize("spec", exact_cases(greedy=True))
@pytest.mark.slow
def test_exact_engine_greedy_tokens_match_standard(
    spec: str, smollm2: Model, standard_greedy_tokens: list[int]
) -> None:
    assert _greedy_tokens(smollm2, spec) == standard_greedy_tokens


TINY_ARCHS = [
    "llama",
    "gemma3",
    "gemma4",
    "gemma4_moe",
    "gemma4_shared",
    "gemma4_ple",
    "mixtral",
    "qwen2_moe",
    "gpt_oss",
]
# Every live engine runs on the tiny llama here (and on gemma4_global below); on the other
# architectures one engine of each kind does, and the others there are `long`: the eviction
# policies and the default compositions score and drop tokens alike on every architecture, and
# snapkv and the evicting composition stand for them there; markov-rs stands for the residual
# store markov-rs-codec and boundary-per-layer share, turbo-quant for the engine and store
# kv-quant shares; standard runs on every architecture as the exact engines' reference.
EVERY_ARCH_SPECS = {
    "no-cache",
    "markov-rs",
    "windowed-checkpoint",
    "turbo-quant",
    "snapkv",
    "boundary-kv",
    "semantic-promotion",
    "snapkv:budget=4,window=2+turbo-quant:bits=3",
}
EVERY_ARCH_LIVE = [s for s in LIVE_SPECS if s in EVERY_ARCH_SPECS]
# The MoE variants attend as their dense kin do (mixtral as llama, qwen2_moe as qwen2 with its
# K/V biases, gemma4_moe as gemma4): there the engines that compute rows again (the whole
# sequence, a window, K/V from stored residuals) run; those that change only which rows
# attention reads, or how they are stored, are `long` there, run on the dense architectures.
MOE_ARCHS = {"mixtral", "qwen2_moe", "gemma4_moe"}
RECOMPUTING = {"no-cache", "markov-rs", "windowed-checkpoint", "semantic-promotion"}
TINY_ARCH_CASES = [
    pytest.param(
        arch,
        spec,
        marks=pytest.mark.long if arch in MOE_ARCHS and spec not in RECOMPUTING else (),
    )
    for arch in TINY_ARCHS
    for spec in EVERY_ARCH_LIVE
]
LLAMA_ONLY_LIVE = [s for s in LIVE_SPECS if s not in EVERY_ARCH_SPECS]


def _tiny(arch: str, tmp_path_factory: pytest.TempPathFactory) -> Model:
    pytest.importorskip("transformers")
    directory: Path = tmp_path_factory.mktemp(f"compliance-{arch}")
    build_tiny_model(arch, directory)
    return load_model(str(directory), dtype=torch.float64)


@pytest.fixture(scope="module")
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Model:
    return _tiny(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return _tiny("llama", tmp_path_factory)


@pytest.fixture(scope="module", params=[a for a in TINY_ARCHS if a != "llama"])
def other_tiny_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Model:
    return _tiny(request.param, tmp_path_factory)


def _runs_on_tiny(spec: str, model: Model) -> None:
    """The sliding-layer tiny models' windows (6) are narrower than the prompt (8)."""
    ids = random_ids(14, seed=7)
    try:
        logits = teacher_forced(model, spec, ids, 8)
    except EngineError as e:
        pytest.fail(f"{spec} failed on {model.config.arch.name}: {e}")
    assert torch.isfinite(logits).all()
    if spec in exact_specs() or spec == "standard":
        reference = teacher_forced(model, "standard", ids, 8)
        assert ((logits - reference).abs().max() / reference.abs().max()).item() <= 1e-9


@pytest.mark.parametrize(("tiny_model", "spec"), TINY_ARCH_CASES, indirect=["tiny_model"])
def test_live_engines_run_on_tiny_architectures(spec: str, tiny_model: Model) -> None:
    _runs_on_tiny(spec, tiny_model)


@pytest.mark.parametrize("spec", LLAMA_ONLY_LIVE)
def test_the_other_live_engines_run_on_the_tiny_llama(spec: str, tiny_llama: Model) -> None:
    _runs_on_tiny(spec, tiny_llama)


@pytest.mark.long  # the tiny llama above, and gemma4_global below, run these engines
@pytest.mark.parametrize("spec", LLAMA_ONLY_LIVE)
def test_the_other_live_engines_run_on_the_other_tiny_architectures(
    spec: str, other_tiny_model: Model
) -> None:
    _runs_on_tiny(spec, other_tiny_model)


@pytest.fixture(scope="module")
def gemma4_global(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """Gemma 4's global layers: a head width and K/V head count of their own, keys as values."""
    pytest.importorskip("transformers")
    directory: Path = tmp_path_factory.mktemp("compliance-gemma4-global")
    build_tiny_model("gemma4_global", directory)
    return load_model(str(directory), dtype=torch.float64)


@pytest.mark.parametrize("spec", LIVE_SPECS)
def test_live_engines_run_layers_of_two_head_widths(spec: str, gemma4_global: Model) -> None:
    """Every live engine runs a model whose layers differ in head width and K/V heads (the
    codec engines with a codec per width), the exact ones as standard does."""
    ids = random_ids(20, seed=7)
    logits = teacher_forced(gemma4_global, spec, ids, 10)
    assert torch.isfinite(logits).all()
    if spec in exact_specs():
        reference = teacher_forced(gemma4_global, "standard", ids, 10)
        assert ((logits - reference).abs().max() / reference.abs().max()).item() <= 1e-9


def test_codec_engines_keep_a_codec_per_head_width(gemma4_global: Model) -> None:
    """turbo-quant with every row coded (no exact rows) codes a global layer's 32-wide K/V
    heads with a 32-wide codec and the sliding layers' 16-wide ones with theirs: attending in
    each layer's rotated basis gives what attending over the decoded rows gives."""
    from larql.kv.turbo_quant import TurboQuantEngine
    from larql.kv.turbo_quant.codec import TurboQuantCodec

    ids = random_ids(20, seed=7)
    model, ffn, cfg = gemma4_global, DenseFfn(gemma4_global), gemma4_global.config
    logits = []
    for rotated in (True, False):
        engine = TurboQuantEngine(bits=4, attention="sdpa", rotated_attention=rotated)
        with torch.inference_mode():
            hidden = engine.prefill(model, ffn, ids[:10])
            steps = [hidden[-1:]] + [engine.decode_step(model, ffn, t) for t in ids[10:]]
        logits.append(torch.cat([final_logits(model, h) for h in steps]))
        for layer in range(cfg.num_layers):
            per_vector = TurboQuantCodec(cfg.head_dim_of(layer), 4).bytes_per_vector
            codes = engine.stored_codes(layer)  # [tokens kept, row bytes]
            assert codes.shape[1] == 2 * cfg.kv_heads_of(layer) * per_vector
    assert {cfg.head_dim_of(layer) for layer in range(cfg.num_layers)} == {16, 32}
    # the codecs decode in float32: the two paths sum in another order (a wrong rotation for a
    # layer's width would be off by O(1))
    assert torch.allclose(logits[0], logits[1], rtol=0, atol=1e-5)
