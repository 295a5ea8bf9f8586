"""`larql bench --workers N` and the placement of workers: the engines spread over processes
give one process's report shape with every engine once; worker i's device and cores."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from larql.cli.app import app
from larql.harness.bench.run import _in_order
from larql.harness.workers import shares_hardware, worker_cores, worker_device


def test_a_bare_cuda_spreads_workers_over_the_gpus() -> None:
    assert [worker_device("cuda", i, 4) for i in range(6)] == [
        "cuda:0",
        "cuda:1",
        "cuda:2",
        "cuda:3",
        "cuda:0",
        "cuda:1",
    ]
    assert [worker_device("cuda", i, 1) for i in range(3)] == ["cuda:0"] * 3
    # a named GPU, or the CPU, is every worker's
    assert [worker_device("cuda:2", i, 4) for i in range(3)] == ["cuda:2"] * 3
    assert [worker_device("cpu", i, 0) for i in range(3)] == ["cpu"] * 3


def test_each_worker_gets_its_own_cores() -> None:
    cores = [0, 1, 2, 3, 5, 6, 7, 9]  # an affinity set with gaps
    shares = [worker_cores(cores, i, 3) for i in range(3)]
    assert shares == [[0, 1, 2], [3, 5, 6], [7, 9]]
    assert [worker_cores(cores, i, 8) for i in range(8)] == [[c] for c in cores]
    # fewer cores than workers: every worker may use every core
    assert worker_cores([0, 1], 2, 3) == [0, 1]


def test_workers_share_hardware_unless_each_has_a_gpu() -> None:
    assert not shares_hardware("cpu", 1, 0)
    assert shares_hardware("cpu", 2, 0)
    assert not shares_hardware("cuda", 4, 4)
    assert shares_hardware("cuda", 4, 2)
    assert shares_hardware("cuda:0", 2, 4)  # a named GPU holds every worker


def test_rows_are_joined_in_one_process_order() -> None:
    """Engines 0..4 over two workers (0, 2, 4 and 1, 3), two depths, two rows per engine."""
    groups = [[0, 2, 4], [1, 3]]
    parts = [[(d, k, b) for d in (16, 32) for k in group for b in (1, 2)] for group in groups]
    assert _in_order(parts, groups, 2) == [
        (d, k, b) for d in (16, 32) for k in range(5) for b in (1, 2)
    ]


ARGS = ["bench", "--engine", "standard;standard:window=4;turbo-quant:bits=4", "-n", "2"]
ARGS += ["--warmup", "0", "--repeats", "1", "--depths", "8,16", "--batch", "1,2"]
ARGS += ["--threads", "2", "-o", "json"]


@pytest.mark.slow
def test_bench_workers_give_one_process_shape() -> None:
    one = CliRunner().invoke(app, [*ARGS, "-q"])
    two = CliRunner().invoke(app, [*ARGS, "--workers", "2"])
    assert one.exit_code == 0 and two.exit_code == 0, (one.output, two.output)
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    assert set(b) - set(a) == {"workers"} and set(a) <= set(b)
    for key in ("rows", "batch_rows"):
        assert [set(row) for row in a[key]] == [set(row) for row in b[key]]
    named = [(row["label"], row["depth"]) for row in b["rows"]]
    assert named == [(row["label"], row["depth"]) for row in a["rows"]]
    assert len(set(named)) == 6  # every engine once at each depth
    specs = [(row["spec"], row["depth"], row["batch"]) for row in b["batch_rows"]]
    assert specs == [(row["spec"], row["depth"], row["batch"]) for row in a["batch_rows"]]
    assert all(row["tok_s"] > 0 for row in b["rows"])
    # the engines, round-robin over the workers; each pinned to one of the two threads
    assert b["workers"] == [
        {"engines": ["standard", "turbo-quant"], "device": "cpu", "threads": 1},
        {"engines": ["standard:window=4"], "device": "cpu", "threads": 1},
    ]
    assert "warning: 2 bench workers share" in two.stderr
    lines = [line for line in two.stderr.splitlines() if line.startswith("bench: ")]
    assert len(lines) == 2 and all("worker" in line for line in lines)


def test_bench_workers_refuse_bad_counts_and_tensor_parallel() -> None:
    bad = CliRunner().invoke(app, ["bench", "--workers", "0"])
    assert bad.exit_code == 2 and "--workers must be ≥ 1" in bad.stderr
    both = CliRunner().invoke(app, ["bench", "--workers", "2", "--tensor-parallel", "3"])
    assert both.exit_code == 2 and "not both" in both.stderr
    twice = CliRunner().invoke(app, [*ARGS, "--engine", "standard;standard", "--workers", "2"])
    assert twice.exit_code == 2 and "standard is listed twice" in twice.stderr
