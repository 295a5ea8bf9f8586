"""`benchmarks/cold_start.py`: a larql command's wall time by phase, seen from outside the
process, with every thread's stack dumped as it runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cold_start.py"
PHASES = [
    "interpreter up",
    "CLI imported",
    "command returned",
    "threads still alive",
    "exit handlers start",
    "exit handlers done",
    "process ended (exit code 0)",
]


def test_the_phases_of_a_command_in_order_with_its_stacks(tmp_path: Path) -> None:
    measure = [sys.executable, str(SCRIPT), "--dump-every", "0.05", "--out", str(tmp_path)]
    done = subprocess.run(
        [*measure, "--", "engines", "--output", "json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "timeline.txt").read_text().splitlines()
    assert [next(p for p in PHASES if p in line) for line in lines] == PHASES
    seconds = [float(line.split()[0]) for line in lines]
    assert seconds == sorted(seconds) and seconds[0] >= 0
    assert "thread MainThread:" in (tmp_path / "stacks.txt").read_text()  # at least one dump


def test_a_failing_command_passes_its_exit_code_on(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--", "run", "--engine", "nope"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode not in (0, None)
    assert "process ended (exit code" in (tmp_path / "timeline.txt").read_text()
