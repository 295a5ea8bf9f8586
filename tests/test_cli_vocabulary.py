"""One flag, one meaning: `--engine` takes engine specs on every command, `--ffn-policy` FFN
policies, `-n/--max-tokens` new tokens, `--top-k` is sampling's only. The old spellings
(`accuracy --engines` / `--ffn`, `bench --tokens`, `walk --top-k`) still work, hidden from
--help, with a warning that names the new one."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from larql.cli.app import app
from larql.cli.renamed import renamed
from larql.errors import InvalidInput
from larql.kv.resolve import ENV_VAR


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args), terminal_width=200)


def test_renamed_takes_either_spelling_never_both(capsys: pytest.CaptureFixture[str]) -> None:
    assert renamed(5, None, "--new", "--old", 0) == 5
    assert capsys.readouterr().err == ""
    assert renamed(0, 7, "--new", "--old", 0) == 7
    assert "warning: --old is deprecated; use --new" in capsys.readouterr().err
    with pytest.raises(InvalidInput, match="give --new only"):
        renamed(5, 7, "--new", "--old", 0)


OLD_AND_NEW = [
    # (command, old spelling, new spelling, a value both refuse, the refusal)
    ("bench", "--tokens", "--max-tokens", "0", "-n/--max-tokens must be ≥ 1"),
    ("bench", "--engines", "--engine", "nope", "unknown engine 'nope'"),
    ("accuracy", "--engines", "--engine", "nope", "unknown engine 'nope'"),
    ("accuracy", "--ffn", "--ffn-policy", "nope", "nope"),
    ("walk", "--top-k", "--features", "0", "-k/--features must be ≥ 1"),
]


@pytest.mark.parametrize("command, old, new, value, refusal", OLD_AND_NEW)
def test_the_old_spelling_warns_and_means_the_same(
    cli, command: str, old: str, new: str, value: str, refusal: str
) -> None:
    prompt = ["Hello"] if command == "walk" else []
    current = cli(command, *prompt, new, value)
    assert current.exit_code == 2 and refusal in current.stderr
    assert "deprecated" not in current.stderr
    previous = cli(command, *prompt, old, value)
    assert previous.exit_code == 2 and refusal in previous.stderr  # the same option's value
    assert f"warning: {old} is deprecated; use " in previous.stderr
    both = cli(command, *prompt, new, value, old, value)
    assert both.exit_code == 2 and "only" in both.stderr
    shown = cli(command, "--help")
    assert new in shown.stdout and f"{old} " not in shown.stdout.replace(f"{old}-", "")


def test_top_k_is_sampling_only(cli) -> None:
    """walk's features-kept option is -k/--features now; --top-k means sampling (run)."""
    helps = {command: cli(command, "--help").stdout for command in ("run", "walk", "bench")}
    assert "--top-k" in helps["run"]
    assert "--top-k" not in helps["walk"] and "--features" in helps["walk"]


@pytest.mark.parametrize("command", ["run", "walk", "serve", "bench", "accuracy"])
def test_every_model_loading_command_takes_threads(cli, command: str) -> None:
    prompt = ["Hello"] if command in ("run", "walk") else []
    refused = cli(command, *prompt, "--threads", "0")
    assert refused.exit_code == 2 and "--threads must be ≥ 1, got 0" in refused.stderr


@pytest.mark.slow
def test_run_uses_the_threads_given(cli) -> None:
    import torch

    before = torch.get_num_threads()
    try:
        done = cli("run", "Hello", "-n", "1", "--threads", "1")
        assert done.exit_code == 0, done.output
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
