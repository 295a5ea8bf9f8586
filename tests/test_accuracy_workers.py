"""`larql accuracy --workers N`: the work spread over processes gives the report one process
gives, value for value, for every suite; bad worker counts are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from larql.cli.app import app

ARGS = ["accuracy", "--engine", "standard;standard:window=8", "--no-conflict"]
ARGS += ["--parametric-n", "1", "--needle-max-tokens", "64", "--positions", "8"]
ARGS += ["--threads", "1", "--output", "json", "-q"]

# the long-context suites, each on a grid of a few cells: two engines that score apart (the
# full cache and an 8-row window), one task, one short length
ENGINES = ["--engine", "standard;standard:window=8", "--threads", "1", "-q"]
SUITES = {
    "longctx": ["--tasks", "needle-number", "--lengths", "256", "--depth-percent", "0,100"],
    "ruler": ["--tasks", "niah-single", "--lengths", "256", "--samples", "2", "-o", "json"],
    "ppl-position": ["--lengths", "128"],
}


def test_workers_give_the_report_of_one_process() -> None:
    one = CliRunner().invoke(app, ARGS)
    two = CliRunner().invoke(app, [*ARGS, "--workers", "2"])
    assert one.exit_code == 0 and two.exit_code == 0, (one.output, two.output)
    assert json.loads(one.stdout) == json.loads(two.stdout)


@pytest.mark.slow
@pytest.mark.parametrize(
    "suite",
    [
        # long: the three suites spread their cells over the workers through one `gather`
        # (cli/accuracy_longctx.py); ppl-position checks it, and its report, here
        pytest.param("longctx", marks=pytest.mark.long),
        pytest.param("ruler", marks=pytest.mark.long),
        "ppl-position",
    ],
)
def test_workers_give_a_suite_of_one_process(suite: str, tmp_path: Path) -> None:
    """The grid's cells over two workers: the same tables and JSON as one process, and a
    progress line per cell on stderr, in the order the cells finish."""
    runs = []
    for workers in (1, 2):
        out = tmp_path / f"{workers}.json"
        args = ["accuracy", "--suite", suite, *ENGINES, *SUITES[suite], "--output-file", str(out)]
        result = CliRunner().invoke(app, [*args, "--workers", str(workers)])
        assert result.exit_code == 0, result.output
        runs.append((result.stdout, json.loads(out.read_text())))
    assert runs[0] == runs[1]
    cells = {"longctx": 4, "ruler": 4, "ppl-position": 2}[suite]
    report = runs[1][1]
    scored = report.get("cells") or report.get("curves")
    assert len(scored) == cells and len({json.dumps(c) for c in scored}) == cells


def test_progress_says_each_cell_once(tmp_path: Path) -> None:
    """-q off and stderr not a terminal: one line per finished cell, each named once."""
    args = ["accuracy", "--suite", "ppl-position", "--engine", "standard;standard:window=8"]
    result = CliRunner().invoke(app, [*args, "--lengths", "32", "--threads", "1"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("ppl-position: ")]
    assert [line.split("] ")[1] for line in lines] == [
        "standard: 32 positions",
        "standard:window=8: 32 positions",
    ]
    assert lines[0].startswith("ppl-position: 1/2 [") and lines[1].startswith("ppl-position: 2/2")


def test_bad_worker_counts_are_refused() -> None:
    for suite in ("prompts", "longctx"):
        bad = CliRunner().invoke(app, ["accuracy", "--suite", suite, "--workers", "0"])
        assert bad.exit_code == 2 and "--workers must be ≥ 1" in bad.stderr
