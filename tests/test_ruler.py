"""`larql accuracy --suite ruler` on the real default model: the generator (deterministic by
seed, every answer in its context, each family), the scoring, compress-then-ask with a query
per fork, and the command's JSON, table and plot."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from larql.cli.app import app
from larql.harness.ruler.run import _answer, score_sample
from larql.harness.ruler.tasks import (
    QUESTION_RESERVE,
    TASKS,
    Query,
    answer_text,
    dataset_hash,
    generate_samples,
    query_score,
)
from larql.inference.ffn import build_ffn
from larql.kv import parse_engine
from larql.models import Model


def test_the_seed_fixes_the_dataset(smollm2: Model) -> None:
    def samples(seed: int):
        return generate_samples(smollm2.tokenizer, TASKS, (256,), 2, seed)

    assert dataset_hash(samples(3)) == dataset_hash(samples(3))
    assert dataset_hash(samples(3)) != dataset_hash(samples(4))
    made = samples(3)
    assert sorted({s.task for s in made}) == sorted(TASKS)
    assert len(made) == len(TASKS) * 2
    for sample in made:
        tokens = len(smollm2.tokenizer.encode(sample.context))
        # the whole input (context, question, answer) within the length
        assert 0.8 * (256 - QUESTION_RESERVE) <= tokens <= 256, (sample.task, tokens)
        for query in sample.queries:
            for answer in query.answers:
                assert answer in sample.context, (sample.task, answer)


def test_the_families_ask_what_they_name(smollm2: Model) -> None:
    by_task = {s.task: s for s in generate_samples(smollm2.tokenizer, TASKS, (512,), 1, 0)}
    single = by_task["niah-single"]
    assert single.context.count("special magic number") == 1
    assert by_task["niah-multikey"].context.count("special magic number") == 4
    assert len(by_task["niah-multikey"].queries[0].answers) == 1
    multivalue = by_task["niah-multivalue"].queries[0]
    assert len(multivalue.answers) == 2 and len(set(multivalue.answers)) == 2
    multiquery = by_task["niah-multiquery"]
    assert len(multiquery.queries) == 2 and multiquery.context.count("special magic") == 2
    assert multiquery.queries[0].answers != multiquery.queries[1].answers
    tracking = by_task["variable-tracking"]
    asked = tracking.queries[0]
    hop = re.search(r"What is the value of (\w+)\? \1 = (\w+) =", asked.question)
    assert hop is not None
    assert f"VAR {hop[1]} = {hop[2]}." in tracking.context
    assert f'VAR {hop[2]} = "{asked.answers[0]}".' in tracking.context
    assert tracking.context.count("VAR ") == 4  # the asked chain and a distractor
    for task in ("common-words", "frequent-words"):
        words = Counter(re.findall(r"[a-z]+", by_task[task].context.split(". ", 1)[1]))
        (top, top_count), (_, second_count) = words.most_common(2)
        assert by_task[task].queries[0].answers == (top,) and top_count > second_count, task


def test_past_a_short_context_the_defaults_follow_the_calibration(smollm2: Model) -> None:
    from larql.harness.ruler.tasks import DEFAULT_TASKS, SHORT_CONTEXT

    long = SHORT_CONTEXT + 512
    made = generate_samples(smollm2.tokenizer, None, (1024, long), 1, 0)
    by_length = {n: {s.task: s for s in made if s.length == n} for n in (1024, long)}
    assert tuple(by_length[1024]) == DEFAULT_TASKS  # every default task up to the short context
    assert "frequent-words" not in by_length[long]  # the full cache misses it past it
    assert set(by_length[long]) == set(DEFAULT_TASKS) - {"frequent-words"}
    assert by_length[1024]["niah-multikey"].context.count("special magic number") == 4
    assert by_length[long]["niah-multikey"].context.count("special magic number") == 2
    # asked for by name, a family runs at every length
    asked = generate_samples(smollm2.tokenizer, ("frequent-words",), (long,), 1, 0)
    assert [s.task for s in asked] == ["frequent-words"]


def test_scoring_matches_whole_values_and_counts_each_answer() -> None:
    one = Query("q", ("12345",), 8)
    assert query_score(one, "12345") == 1.0
    assert query_score(one, "123456") == 0.0  # a longer number is not the answer
    assert query_score(one, "the value 12345.") == 1.0
    two = Query("q", ("11111", "22222"), 16)
    assert query_score(two, '11111" and "33333"') == 0.5
    assert answer_text(one, '12345". The other is "99999"') == "12345"
    assert answer_text(two, '11111", "22222"\nmore 33333') == '11111", "22222"'


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(min_value=0, max_value=10_000))
def test_any_seed_puts_every_answer_in_its_context(smollm2: Model, seed: int) -> None:
    tasks = ("niah-multikey", "niah-multivalue", "variable-tracking")
    for sample in generate_samples(smollm2.tokenizer, tasks, (192,), 1, seed):
        for query in sample.queries:
            assert all(a in sample.context for a in query.answers), sample.task


@pytest.mark.slow
def test_compress_then_ask_forks_the_compressed_state(smollm2: Model) -> None:
    """Each query of a multi-query sample is answered on a fork of one compressed context, as
    if the context had been prefilled again for it; a 32-row window, which keeps neither
    needle, finds none."""
    ffn = build_ffn(smollm2, "dense")

    def far(sample) -> bool:  # neither needle within the window's 32 rows (~130 characters)
        return all(
            sample.context.index(q.answers[0]) < len(sample.context) - 400 for q in sample.queries
        )

    sample = next(
        s
        for seed in range(20)
        for s in generate_samples(smollm2.tokenizer, ("niah-multiquery",), (256,), 1, seed)
        if far(s)
    )
    full = score_sample(smollm2, ffn, parse_engine("standard"), sample)
    assert full.error is None and len(full.predicted) == 2
    context = smollm2.tokenizer.encode(sample.context)
    for query, forked in zip(sample.queries, full.predicted, strict=True):
        engine = parse_engine("standard").build(smollm2)
        hidden = engine.prefill(smollm2, ffn, context)
        assert _answer(engine, smollm2, ffn, hidden, query)[1] == forked
    assert full.score > 0
    window = score_sample(smollm2, ffn, parse_engine("standard:window=32"), sample)
    assert window.score == 0.0 and window.memory_bytes < full.memory_bytes / 4


@pytest.mark.slow
def test_the_command_reports_json_table_and_plot(tmp_path: Path) -> None:
    plot, out = tmp_path / "ruler.png", tmp_path / "ruler.json"
    args = [
        "accuracy",
        "--suite",
        "ruler",
        "--tasks",
        "niah-single,frequent-words",
        "--lengths",
        "256",
        "--samples",
        "2",
        "--engines",
        "standard;standard:window=32",
        "--plot",
        str(plot),
        "--output-file",
        str(out),
    ]
    result = CliRunner().invoke(app, [*args, "--output", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report == json.loads(out.read_text())
    assert report["schema"] == "larql.ruler/1" and report["suite"] == "ruler"
    summary = {row["engine"]: row for row in report["engines"]}
    assert list(summary) == ["standard", "standard:window=32"]
    assert summary["standard"]["score"] >= 0.75 and summary["standard"]["samples"] == 2 * 2
    assert summary["standard:window=32"]["memory_bytes"] < summary["standard"]["memory_bytes"]
    assert {(r["task"], r["length"]) for r in report["tasks"]} == {
        ("niah-single", 256),
        ("frequent-words", 256),
    }
    assert plot.stat().st_size > 0
    # the table of one cell (test_the_table_grows_down_… lays out many engines' rows)
    one = ["accuracy", "--suite", "ruler", "--tasks", "niah-single", "--lengths", "256"]
    table = CliRunner().invoke(app, [*one, "--samples", "1", "--engines", "standard"])
    assert table.exit_code == 0 and "RULER" in table.stdout and "niah-single" in table.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tasks", "needle-number"], "known for --suite ruler"),
        (["--samples", "0"], "--samples must be ≥ 1"),
        (["--depth-percent", "50"], "drop --depth-percent"),
        (["--lengths", "64"], "integers ≥ 128"),
    ],
)
def test_bad_ruler_options_are_refused(extra: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["accuracy", "--suite", "ruler", *extra])
    assert result.exit_code == 2 and message in result.stderr, result.output


def test_samples_is_for_ruler_and_json_for_two_suites() -> None:
    result = CliRunner().invoke(app, ["accuracy", "--suite", "longctx", "--samples", "2"])
    assert result.exit_code == 2 and "--samples is for --suite ruler" in result.stderr
    result = CliRunner().invoke(app, ["accuracy", "--suite", "longctx", "--output", "json"])
    assert result.exit_code == 2 and "--output-file" in result.stderr


@pytest.mark.slow
def test_the_kvpress_comparison_skips_without_its_venv(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "vs_kvpress.py")],
        env={**os.environ, "KVPRESS_PY": str(tmp_path / "none" / "python")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1 and "no kvpress Python" in result.stdout


def _vs_kvpress():
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_kvpress.py"
    spec = importlib.util.spec_from_file_location("vs_kvpress", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_kvpress_worker_takes_a_command_a_pythonpath_and_stays_offline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os
    import shutil
    import sys

    bench = _vs_kvpress()
    python = Path(sys.executable)
    monkeypatch.setenv("PATH", str(python.parent))
    assert bench._kvpress_command(python.name) == [shutil.which(python.name)]
    assert bench._kvpress_command(f"{python} -X utf8") == [str(python), "-X", "utf8"]
    assert bench._kvpress_command("no-such-python-here") is None
    monkeypatch.setenv("PYTHONPATH", "/already")
    env = bench._worker_env("/target")
    assert env["PYTHONPATH"].split(os.pathsep) == ["/target", "/already"]
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    monkeypatch.delenv("PYTHONPATH")
    assert bench._worker_env("/target")["PYTHONPATH"] == "/target"
    assert "PYTHONPATH" not in bench._worker_env(None)
    # two templates of one engine are two rows
    assert bench._label("kvzip:keep={keep},heads=adaptive") == "kvzip:heads=adaptive"
    assert bench._label("kvzip:keep={keep}") == "kvzip"


def test_the_table_grows_down_with_the_engines_and_never_breaks_a_name() -> None:
    from rich.console import Console

    from larql.harness.ruler.report import ruler_table
    from larql.harness.ruler.run import Cell
    from larql.harness.ruler.tasks import DEFAULT_TASKS

    engines = [f"{name}:keep=0.5,heads=adaptive" for name in ("snapkv", "kvzip", "keydiff")]
    engines += ["standard", "expected-attention:keep=0.25", "tova:keep=0.1"]
    cells = [
        Cell(e, t, n, 0, 0.5, 2**20, n, ["x"])
        for e in engines
        for t in DEFAULT_TASKS
        for n in (1024, 2048)
    ]
    console = Console(width=100, record=True)
    console.print(ruler_table(cells))
    text = console.export_text()
    for engine in engines:  # each engine's rows: one a length, and its mean over them
        assert sum(1 for line in text.splitlines() if f" {engine} " in line) == 3
    assert "niah-single" in text and "left out at 100 columns" in text
