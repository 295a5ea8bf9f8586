"""What a new user meets first: a typo is answered before torch loads, the `--load-state`
notice has a line of its own, a `Generation` prints short, a bad `LARQL_KV_ENGINE` is named as
the environment's, and a missing model says how to get one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import larql
from larql.cli.app import app
from larql.cli.progress import progress_lines
from larql.kv.resolve import ENV_VAR, resolve_engine
from larql.kv.spec import UnknownEngine
from larql.models.model import Model
from larql.models.registry import ModelNotFound, resolve_model_path

# Runs the command line in a fresh interpreter and prints, at exit, whether torch was imported.
TORCH_AT_EXIT = (
    "import atexit, sys; "
    "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules, file=sys.stderr)); "
    "from larql.cli.app import main; sys.argv = ['larql', *sys.argv[1:]]; main()"
)

TYPOS = [
    ["runn", "Hello"],  # an unknown command
    ["run", "Hello", "--max-token", "3"],  # an unknown option
    ["run", "Hello", "-n", "three"],  # a value of the wrong type
    ["run", "Hello", "--output", "xml"],  # a value the command refuses
    ["run", "Hello", "-n", "0"],
    ["bench", "--engin", "standard"],
    ["bench", "--output", "csv"],
    ["accuracy", "--engins", "standard"],
    ["serve", "--prot", "8000"],
    ["engines", "--output", "yaml", "--bogus"],
    ["boundary", "lss"],
]


@pytest.mark.parametrize("args", TYPOS, ids=[" ".join(a) for a in TYPOS])
def test_a_typo_is_answered_without_importing_torch(args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", TORCH_AT_EXIT, *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "torch imported: False" in done.stderr


def test_a_bad_engine_in_the_environment_is_named_as_such() -> None:
    with pytest.raises(UnknownEngine) as raised:
        resolve_engine(None, env={ENV_VAR: "turbo-qant"})
    message = str(raised.value)
    assert f"environment variable {ENV_VAR}='turbo-qant'" in message
    assert "supported: standard" in message  # the catalog's list, as on the command line
    with pytest.raises(UnknownEngine) as typed:  # typed on the command line: no variable named
        resolve_engine("turbo-qant", env={})
    assert ENV_VAR not in str(typed.value)
    # --engine overrides a bad variable, as the message says
    assert resolve_engine("standard", env={ENV_VAR: "turbo-qant"}).engine.spec() == "standard"


def test_the_command_line_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "standard:window=x")
    done = CliRunner().invoke(app, ["run", "Hello", "-n", "1"])
    assert done.exit_code == 2
    assert done.stderr.startswith(f"error: the environment variable {ENV_VAR}=")


def test_a_missing_model_says_how_to_get_one(tmp_path: Path) -> None:
    for given in ("smolm2", str(tmp_path / "model.gguf"), str(tmp_path)):
        with pytest.raises(ModelNotFound) as raised:
            resolve_model_path(given)
        message = str(raised.value)
        assert "`larql models`" in message and ".gguf" in message and "config.json" in message
    done = CliRunner().invoke(app, ["run", "Hello", "-m", "smolm2"])
    assert done.exit_code == 2 and "larql models" in done.stderr


def test_a_generation_prints_short(smollm2_default: Model) -> None:
    result = larql.generate(smollm2_default, "standard", "Once upon a time", max_new_tokens=80)
    shown = repr(result)
    assert len(shown) <= 300 and "\n" not in shown
    assert "tokens=80" in shown and "engine='standard'" in shown
    assert repr(result.text[:20])[1:-1] in shown  # the head of the text
    assert len(result.text) > 60 and "…" in shown


def test_the_load_state_notice_has_a_line_of_its_own(
    tmp_path: Path, smollm2_default: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    runner = CliRunner()
    state = tmp_path / "state"
    saved = runner.invoke(
        app, ["run", "The capital of France is", "-n", "2", "--save-state", str(state)]
    )
    assert saved.exit_code == 0, saved.output
    assert "\nsaved state: " in saved.output  # after the text's line, not glued to it
    loaded = runner.invoke(app, ["run", "", "-n", "3", "--load-state", str(state)])
    assert loaded.exit_code == 0, loaded.output
    text = loaded.stdout
    assert text.endswith("\n") and loaded.output.startswith(text.rstrip("\n") + "\n")
    assert "\nloaded state: " in loaded.output


def test_progress_is_a_line_per_item_where_stderr_is_not_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with progress_lines("accuracy", 3) as advance:
        for label in ("corpora: standard", "fidelity: reference (standard)", "fidelity: h2o"):
            advance(label)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("] ")[1] for line in lines] == [
        "corpora: standard",
        "fidelity: reference (standard)",
        "fidelity: h2o",
    ]
    assert [line.split(" [")[0] for line in lines] == [f"accuracy: {i}/3" for i in (1, 2, 3)]
    with progress_lines("accuracy", 3, quiet=True) as advance:
        advance("corpora: standard")
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_bench_reports_progress_unless_quiet(
    smollm2_default: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    args = ["bench", "--engine", "standard", "-n", "1", "--repeats", "1", "--warmup", "0"]
    args += ["--depths", "0,4", "--output", "json"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    lines = [line for line in done.stderr.splitlines() if line.startswith("bench: ")]
    assert [line.split(" [")[0] for line in lines] == ["bench: 1/2", "bench: 2/2"]
    assert lines[0].endswith("standard @ depth 0 (1 interleaved rounds)")
    quiet = CliRunner().invoke(app, [*args, "--quiet"])
    assert quiet.exit_code == 0 and "bench: " not in quiet.stderr
