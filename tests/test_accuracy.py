"""`larql accuracy` logic on the real default model with small counts: metric arithmetic,
outcome mapping and served-rate rules, exact engines at zero KL, the JSON report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from helpers import first_layers
from larql.cli.app import app
from larql.harness.accuracy.aggregate import conflict_axis, fact_axis, strategy_splits
from larql.harness.accuracy.corpora import haystack_with_needle, needle_prompts
from larql.harness.accuracy.fidelity import kl_divergence, measure_fidelity, reference_run
from larql.harness.accuracy.metrics import (
    cosine_similarity,
    first_divergence,
    js_divergence,
    mse,
    reciprocal_rank,
    token_match_rate,
    top_k_overlap,
)
from larql.harness.accuracy.scoring import Outcome, PromptScore, answer_bits, answer_matches
from larql.inference.errors import (
    BackendFailure,
    BackendUnavailable,
    EmptyPrompt,
    InvariantViolation,
    RetrievalMiss,
)
from larql.inference.ffn import DenseFfn
from larql.kv import parse_engine
from larql.models import Model


def test_kl_of_identical_distributions_is_zero() -> None:
    logits = torch.randn(3, 50, dtype=torch.float64)
    assert torch.equal(kl_divergence(logits, logits), torch.zeros(3, dtype=torch.float64))


def test_kl_of_a_known_pair_matches_a_hand_computation() -> None:
    p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    q = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
    by_hand = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5) + 0.25 * math.log(1.0)
    assert float(kl_divergence(p.log(), q.log())) == pytest.approx(by_hand, abs=1e-15)
    assert by_hand == pytest.approx(0.25 * math.log(2))


def test_answer_matching_and_bits(smollm2: Model) -> None:
    assert answer_matches(" Paris", "Paris") and answer_matches(" Row", "Rowling")
    assert not answer_matches(" ", "Paris") and not answer_matches(" London", "Paris")
    paris = smollm2.tokenizer.encode(" Paris")[0]
    logits = torch.full((smollm2.config.vocab_size,), -1e9)
    logits[paris] = 0.0
    logits[0] = 0.0  # two equally likely tokens → exactly 1 bit
    assert answer_bits(smollm2, logits, "Paris") == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (EmptyPrompt(), Outcome.SKIPPED_EMPTY_PROMPT),
        (RetrievalMiss("x"), Outcome.SKIPPED_RETRIEVAL_MISS),
        (BackendUnavailable(), Outcome.SKIPPED_BACKEND_UNAVAILABLE),
        (InvariantViolation("x"), Outcome.SKIPPED_INVARIANT_VIOLATION),
        (BackendFailure("x"), Outcome.SKIPPED_BACKEND_FAILURE),
    ],
)
def test_each_engine_error_maps_to_its_own_outcome(error, outcome: Outcome) -> None:
    assert Outcome.from_error(error) is outcome


def score(source: str, outcome: Outcome = Outcome.SERVED, **fields) -> PromptScore:
    return PromptScore(
        prompt="p",
        category="c",
        source=source,
        kv_engine="e",
        ffn_backend="dense",
        strategy="e",
        expected="x",
        outcome=outcome,
        **fields,
    )


def test_served_rate_rules() -> None:
    served = [
        score("parametric", matched=True, bits=1.0),
        score("parametric", matched=False, bits=3.0),
        score("parametric", Outcome.SKIPPED_RETRIEVAL_MISS),
    ]
    axis = fact_axis(served)
    assert (axis.n, axis.served) == (3, 2)
    assert axis.rate == 0.5 and axis.mean_bits == 2.0  # over served prompts only
    assert axis.served_rate == pytest.approx(2 / 3)
    nothing_served = fact_axis([score("parametric", Outcome.SKIPPED_BACKEND_FAILURE)])
    assert math.isnan(nothing_served.rate) and nothing_served.served_rate == 0.0
    empty = fact_axis([])
    assert math.isnan(empty.rate) and math.isnan(empty.served_rate)
    conflicts = conflict_axis(
        [
            score("conflict", followed_context=True, parametric_fallback=False),
            score("conflict", followed_context=False, parametric_fallback=True),
            score("conflict", followed_context=False, parametric_fallback=False),
            score("conflict", Outcome.SKIPPED_EMPTY_PROMPT),
        ]
    )
    assert conflicts.rate == pytest.approx(1 / 3) and conflicts.fallback_rate == pytest.approx(
        1 / 3
    )
    assert conflicts.served_rate == 0.75
    (split,) = strategy_splits([*served, *conflicts_list()])
    assert split.parametric.served == 2


def conflicts_list() -> list[PromptScore]:
    return [score("conflict", followed_context=True, parametric_fallback=False)]


def test_needles_have_the_requested_length(smollm2: Model) -> None:
    for n, prompt in needle_prompts(smollm2.tokenizer, 1024, smollm2.config.max_positions):
        length = len(smollm2.tokenizer.encode(prompt.prompt))
        assert n - 32 <= length <= n + 32
        assert "ZEPHYR-4821" in prompt.prompt and prompt.expected == "ZEPHYR"
    assert [n for n, _ in needle_prompts(smollm2.tokenizer, 100_000, 8192)][-1] == 4096
    assert haystack_with_needle(smollm2.tokenizer, 300).endswith("code name is")


@pytest.mark.slow
def test_exact_engines_have_zero_kl_and_full_agreement(smollm2: Model) -> None:
    model = first_layers(smollm2, 2)  # the metrics, on real weights at a fraction of the cost
    ffn = DenseFfn(model)
    ids = model.tokenizer.encode(
        Path(__file__).resolve().parents[1].joinpath("LICENSE").read_text()
    )[:60]
    reference = reference_run(model, ffn, parse_engine("standard"), ids, 12)
    same = measure_fidelity(model, ffn, parse_engine("standard"), ids, 12, reference)
    assert same.positions == 48
    assert same.mean_kl == 0.0 and same.max_kl == 0.0 and same.same_top1 == 1.0
    assert same.delta_p_rms == 0.0 and same.ln_ppl_ratio == 0.0
    assert same.mean_js == 0.0 and same.top5_overlap == 1.0 and same.mrr == 1.0
    assert same.hidden_cosine == pytest.approx(1.0, abs=1e-12) and same.hidden_mse == 0.0
    oracle = measure_fidelity(model, ffn, parse_engine("no-cache"), ids, 12, reference, 20)
    assert oracle.positions == 20
    assert oracle.max_kl <= 1e-6 and oracle.same_top1 == 1.0
    windowed = measure_fidelity(model, ffn, parse_engine("standard:window=8"), ids, 12, reference)
    assert windowed.mean_kl > 1e-3  # a sliding window of 8 really changes the distribution
    # and every other metric sees it, within its range
    assert 0 < windowed.mean_js <= math.log(2) and windowed.mean_js < windowed.mean_kl
    assert 0 < windowed.top5_overlap < 1 and 0 < windowed.mrr < 1
    assert 0 < windowed.hidden_cosine < 1 and windowed.hidden_mse > 0


def test_pure_metrics_on_hand_computed_cases() -> None:
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    assert cosine_similarity(a, b) == 0.0 and cosine_similarity(a, 3 * a) == pytest.approx(1.0)
    assert cosine_similarity(a, torch.zeros(2)) == 0.0
    assert mse(a, b) == pytest.approx((1 + 4) / 2)
    p, q = torch.tensor([0.0, -1e9]), torch.tensor([-1e9, 0.0])  # all mass on different tokens
    assert js_divergence(p, q) == pytest.approx(math.log(2)) and js_divergence(p, p) == 0.0
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0])
    assert reciprocal_rank(0, logits) == 1.0 and reciprocal_rank(1, logits) == pytest.approx(1 / 3)
    assert top_k_overlap(logits, torch.tensor([0.0, 3.0, 2.0, 1.0]), 2) == 0.5
    assert token_match_rate([1, 2, 3], [1, 5, 3, 4]) == pytest.approx(2 / 3)
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1 and first_divergence([1], [1, 2]) is None


def test_corpora_sizes_and_parametric_n(smollm2: Model) -> None:
    from larql.harness.accuracy.corpora import CONFLICT, PARAMETRIC
    from larql.harness.accuracy.run import AccuracySettings, corpora

    assert len(PARAMETRIC) == 100 and len(CONFLICT) >= 20
    assert len({p.prompt for p in PARAMETRIC}) == 100  # no prompt twice
    parametric, _, _ = corpora(smollm2, AccuracySettings(parametric_n=12, conflict=False))
    assert parametric == list(PARAMETRIC[:12])
    result = CliRunner().invoke(app, ["accuracy", "--parametric-n", "0"])
    assert result.exit_code == 2 and "parametric_n must be ≥ 1" in result.stderr


@pytest.mark.slow
def test_cli_report(tmp_path: Path) -> None:
    out, plot = tmp_path / "accuracy.json", tmp_path / "frontier.png"
    result = CliRunner().invoke(
        app,
        [
            "accuracy",
            "--quick",
            "--engine",
            "standard;standard:window=16",
            "--positions",
            "16",
            "--needle-max-tokens",
            "256",
            "--output-file",
            str(out),
            "--plot",
            str(plot),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "Engine Split" in result.stdout and "Teacher-forced fidelity" in result.stdout
    report = json.loads(out.read_text())
    assert report["schema"] == "larql.accuracy/1"
    assert report["kv_engines"] == ["standard", "standard:window=16"]
    assert (report["parametric_n"], report["needle_n"], report["conflict_n"]) == (5, 1, 5)
    assert [s["strategy"] for s in report["splits"]] == ["standard", "standard:window=16"]
    assert len(report["per_prompt"]) == 2 * 6 and len(report["per_conflict"]) == 2 * 5
    standard = report["fidelity"][0]
    assert standard["mean_kl"] == 0.0 and standard["positions"] == 16
    assert standard["ratio_vs_fp16"] == pytest.approx(2.0)  # float32 K/V over an fp16 cache
    assert report["fidelity"][1]["ratio_vs_fp16"] < 2.0  # the window keeps 16 of 272 rows
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the KL-against-bytes frontier
    assert "Apache License" in report["fidelity_text"]


def test_cli_rejects_unknown_engines() -> None:
    result = CliRunner().invoke(app, ["accuracy", "--engine", "standard,bogus"])
    assert result.exit_code == 2 and "unknown engine 'bogus'" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_quick_fidelity_scores_the_quantisers_codes(smollm2: Model, bits: int) -> None:
    """`--quick` scores positions behind a prompt long enough that turbo-quant's defaults hold
    most rows as codes, not in their exact or int8 newest rows (behind the 16-token prompt
    that the full run takes, 128 positions would leave the 3-bit default no code at all)."""
    from larql.data import default_text
    from larql.harness.accuracy.run import QUICK_FIDELITY_POSITIONS, QUICK_FIDELITY_PROMPT

    ids = smollm2.tokenizer.encode(default_text())
    spec = parse_engine(f"turbo-quant:bits={bits}")

    def codes_after(tokens: int) -> int:
        engine = spec.build(smollm2)
        engine.prefill(smollm2, DenseFfn(smollm2), ids[:tokens])
        try:
            return int(engine.stored_codes(0).shape[0])
        except ValueError:  # the store has no coded row yet
            return 0

    assert codes_after(QUICK_FIDELITY_PROMPT) >= QUICK_FIDELITY_PROMPT // 4  # the first scored
    if bits == 3:
        assert codes_after(16 + QUICK_FIDELITY_POSITIONS) == 0
