"""`larql accuracy --workers N`: the engines spread over processes give the report one process
gives, value for value; bad worker counts are refused in one line."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from larql.cli.app import app

ARGS = ["accuracy", "--engine", "standard;standard:window=8", "--no-conflict"]
ARGS += ["--parametric-n", "1", "--needle-max-tokens", "64", "--positions", "8"]
ARGS += ["--threads", "1", "--output", "json", "-q"]


def test_workers_give_the_report_of_one_process() -> None:
    one = CliRunner().invoke(app, ARGS)
    two = CliRunner().invoke(app, [*ARGS, "--workers", "2"])
    assert one.exit_code == 0 and two.exit_code == 0, (one.output, two.output)
    assert json.loads(one.stdout) == json.loads(two.stdout)


def test_bad_worker_counts_are_refused() -> None:
    bad = CliRunner().invoke(app, ["accuracy", "--workers", "0"])
    assert bad.exit_code == 2 and "--workers must be ≥ 1" in bad.stderr
    other = CliRunner().invoke(app, ["accuracy", "--suite", "ruler", "--workers", "2"])
    assert other.exit_code == 2 and "--workers spreads --suite prompts" in other.stderr
