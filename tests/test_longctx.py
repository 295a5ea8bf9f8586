"""`larql accuracy --suite longctx | ppl-position` on the real default model: deterministic
tasks, compress-then-ask scoring that sees what an engine forgets after the prefill, the
versioned JSON, and per-position perplexity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from larql.cli.app import app
from larql.harness.longctx.run import score_sample
from larql.harness.longctx.tasks import TASKS, dataset_hash, generate_samples
from larql.kv import parse_engine
from larql.kv.buffers import KvBuffer
from larql.kv.standard.engine import StandardEngine
from larql.models import Model


def test_the_seed_fixes_the_dataset(smollm2: Model) -> None:
    def samples(seed: int):
        return generate_samples(smollm2.tokenizer, TASKS, (256,), (0, 100), seed)

    assert dataset_hash(samples(3)) == dataset_hash(samples(3))
    assert dataset_hash(samples(3)) != dataset_hash(samples(4))
    for sample in samples(3):
        tokens = len(smollm2.tokenizer.encode(sample.context))
        assert 0.9 * 256 <= tokens <= 1.25 * 256, (sample.task, tokens)
        first_value = sample.answer.split('"')[0]
        assert first_value in sample.context, sample.task  # the answer is in the context


def test_the_needle_sits_at_its_depth(smollm2: Model) -> None:
    early, late = generate_samples(smollm2.tokenizer, ("needle-word",), (512,), (0, 100), 0)
    assert early.context.index("secret word") < 200
    assert late.context.index("secret word") > len(late.context) - 200


class _Forgetful(StandardEngine):
    """Test-only: drops every K/V row right after the prefill."""

    def prefill(self, model, ffn, token_ids):
        hidden = super().prefill(model, ffn, token_ids)
        self._layers = [KvBuffer() for _ in self._layers]
        return hidden


class _ForgetfulSpec:
    def spec(self) -> str:
        return "forgetful"

    def build(self, model: Model) -> StandardEngine:
        return _Forgetful()


@pytest.mark.slow
def test_scoring_sees_what_is_forgotten_after_the_prefill(smollm2: Model) -> None:
    from larql.inference.ffn import DenseFfn

    ffn = DenseFfn(smollm2)
    samples = generate_samples(smollm2.tokenizer, ("needle-number",), (256,), (75,), 1)
    for sample in samples:
        full = score_sample(smollm2, ffn, parse_engine("standard"), sample)
        forgot = score_sample(smollm2, ffn, _ForgetfulSpec(), sample)
        assert full.score == 1.0 and full.predicted == sample.answer
        assert forgot.score == 0.0 and forgot.answer_logprob < full.answer_logprob - 5


@pytest.mark.slow
def test_cli_longctx_report(tmp_path: Path) -> None:
    out, plot = tmp_path / "longctx.json", tmp_path / "longctx.png"
    result = CliRunner().invoke(
        app,
        [
            "accuracy",
            "--suite",
            "longctx",
            "--tasks",
            "needle-number",
            "--lengths",
            "256",
            "--depth-percent",
            "0,100",
            "--engine",
            "standard;standard:window=32",
            "--output-file",
            str(out),
            "--plot",
            str(plot),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["schema"] == "larql.longctx/2" and len(report["dataset_hash"]) == 16
    cells = {(c["engine"], c["depth_percent"]): c for c in report["cells"]}
    assert all(c["depth"] == c["depth_percent"] for c in report["cells"])  # the first schema's
    assert set(cells) == {(e, d) for e in ("standard", "standard:window=32") for d in (0, 100)}
    assert all(cells[("standard", d)]["score"] == 1.0 for d in (0, 100))
    assert cells[("standard:window=32", 0)]["score"] == 0.0  # 250 tokens before the question
    window, full = cells[("standard:window=32", 0)], cells[("standard", 0)]
    assert window["memory_bytes"] < full["memory_bytes"] / 4
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--suite", "longest"], "--suite must be one of"),
        (["--suite", "longctx", "--tasks", "needle-color"], "unknown needle-color"),
        (
            ["--suite", "longctx", "--depth-percent", "150"],
            "--depth-percent takes integers in 0..100",
        ),
        (["--suite", "longctx", "--lengths", "1k"], "--lengths takes comma-separated"),
    ],
)
def test_cli_rejects_bad_grids(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["accuracy", *args])
    assert result.exit_code == 2 and message in result.stderr, result.output


@pytest.mark.slow
def test_cli_ppl_position(tmp_path: Path) -> None:
    out = tmp_path / "ppl.json"
    result = CliRunner().invoke(
        app,
        [
            "accuracy",
            "--suite",
            "ppl-position",
            "--lengths",
            "97",
            "--engine",
            "standard;standard:window=16",
            "--output-file",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    full, window = json.loads(out.read_text())["curves"]
    assert full["bin_edges"][0] == 1 and full["bin_edges"][-1] == 97 and len(full["mean_nll"]) == 16
    assert window["mean_nll"][:2] == pytest.approx(full["mean_nll"][:2], abs=1e-5)  # < 16 back
    assert window["mean_nll"][-1] != pytest.approx(full["mean_nll"][-1], abs=1e-3)


def _cells(model: Model, spec: str, samples) -> list:
    from larql.inference.ffn import DenseFfn

    return [score_sample(model, DenseFfn(model), parse_engine(spec), s) for s in samples]


# long: test_engine_compliance checks these engines' tokens against standard, and
# test_scoring_sees_what_is_forgotten_after_the_prefill that scoring sees what an engine
# changes after the prefill
@pytest.mark.long
def test_exact_engines_score_cell_for_cell_like_standard(smollm2: Model) -> None:
    """(`no-cache`, which recomputes the whole context for every answer token, is left out: its
    tokens and logits against standard's are test_exactness.py's.)"""
    samples = generate_samples(smollm2.tokenizer, ("needle-key",), (100,), (100,), 2)
    standard = _cells(smollm2, "standard", samples)
    for spec in ("markov-rs", "boundary-kv"):
        for ours, theirs in zip(_cells(smollm2, spec, samples), standard, strict=True):
            assert ours.score == theirs.score and ours.predicted == theirs.predicted
            assert ours.answer_logprob == pytest.approx(theirs.answer_logprob, abs=1e-3)
    for spec in ("turbo-quant:bits=4", "kv-quant:bits=4"):  # compress after the prefill
        changed = _cells(smollm2, spec, samples)
        assert all(
            abs(a.answer_logprob - b.answer_logprob) > 1e-4
            for a, b in zip(changed, standard, strict=True)
        )


# long: test_cli_longctx_report checks a 32-row window forgets a needle standard finds, and
# test_scoring_sees_what_is_forgotten_after_the_prefill that scoring sees it
@pytest.mark.long
def test_a_window_forgets_exactly_the_needles_beyond_it(smollm2: Model) -> None:
    # seed 5's needles sit 284 and 59 tokens back from the answer: just beyond, well within
    samples = generate_samples(smollm2.tokenizer, ("needle-number",), (512,), (50, 90), 5)
    standard = _cells(smollm2, "standard", samples)
    windowed = _cells(smollm2, "standard:window=256", samples)
    tokenizer = smollm2.tokenizer
    for sample, full, window in zip(samples, standard, windowed, strict=True):
        before = sample.context[: sample.context.index("The secret number")]
        answer_at = len(tokenizer.encode(sample.context + sample.question))  # first answer row
        distance = answer_at - len(tokenizer.encode(before))  # to the needle's first token
        assert full.score == 1.0
        if distance > 255 + 12:  # the needle's value (≤ 12 tokens in) is out of the window
            assert window.score == 0.0, distance
        elif distance < 240:
            assert window.score == 1.0 and window.predicted == full.predicted, distance


def test_passage_qa_asks_back_the_one_definition_placed(smollm2: Model) -> None:
    for depth in (0, 50, 100):
        (sample,) = generate_samples(smollm2.tokenizer, ("passage-qa",), (512,), (depth,), 7)
        assert sample.context.count("shall mean") == 1  # the others are left out
        assert sample.answer.startswith(" ") and sample.answer.strip() in sample.context
        assert len(sample.answer.split()) == 8


@pytest.mark.slow
def test_apollo_answers_from_a_store_built_of_the_context(smollm2: Model) -> None:
    from larql.inference.ffn import DenseFfn

    ffn = DenseFfn(smollm2)
    sample = generate_samples(smollm2.tokenizer, ("needle-number",), (512,), (25,), 0)[0]
    cell = score_sample(smollm2, ffn, parse_engine("apollo"), sample)
    assert cell.error is None and cell.memory_bytes > 0
    engine = parse_engine("apollo").build(smollm2)
    engine.index_context(smollm2, sample.context)
    assert engine.store.manifest.num_tokens == len(
        smollm2.tokenizer.encode(sample.context, add_special_tokens=False)
    )
    engine.prefill(smollm2, ffn, smollm2.tokenizer.encode(sample.question))
    routed = [int(t) for t in engine.store.window_tokens[engine.injection.window]]
    value = sample.answer.split('"')[0]
    assert value.isdigit() and value in smollm2.tokenizer.decode(routed)  # the needle's window
