"""One flag, one meaning: `--engine` takes engine specs on every command, `--ffn-policy` FFN
policies, `-n/--max-tokens` new tokens, `--prompt-tokens` a prompt's length, `--top-k` is
sampling's only, a bare `--depths` counts tokens and `--depth-percent` says its unit, `--output`
is `text|json` (and `markdown` for the catalog page); `-v` and `--threads` wherever a model runs.
The old spellings (`accuracy --engines` / `--ffn` / `--depths`, `bench --tokens` / `--context`,
`walk --top-k`, `memory --tokens` / `--engines`, `--output table`) still work, hidden from
--help, with a warning that names the new one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from larql.cli.app import app
from larql.cli.renamed import output_format, renamed
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
    # (command, its other arguments, old spelling, new spelling, a value both refuse, the refusal)
    ("bench", [], "--tokens", "--max-tokens", "0", "-n/--max-tokens must be ≥ 1"),
    ("bench", [], "--engines", "--engine", "nope", "unknown engine 'nope'"),
    ("bench", [], "--context", "--prompt-tokens", "0", "--prompt-tokens must be ≥ 1"),
    ("accuracy", [], "--engines", "--engine", "nope", "unknown engine 'nope'"),
    ("accuracy", [], "--ffn", "--ffn-policy", "nope", "nope"),
    (
        "accuracy",
        ["--suite", "longctx"],
        "--depths",
        "--depth-percent",
        "150",
        "--depth-percent takes integers in 0..100",
    ),
    ("walk", ["Hello"], "--top-k", "--features", "0", "-k/--features must be ≥ 1"),
    ("memory", [], "--tokens", "--prompt-tokens", "0", "--prompt-tokens must be ≥ 1"),
    ("memory", ["--prompt-tokens", "8"], "--engines", "--engine", "nope", "unknown engine 'nope'"),
]


@pytest.mark.parametrize("command, others, old, new, value, refusal", OLD_AND_NEW)
def test_the_old_spelling_warns_and_means_the_same(
    cli, command: str, others: list[str], old: str, new: str, value: str, refusal: str
) -> None:
    current = cli(command, *others, new, value)
    assert current.exit_code == 2 and refusal in current.stderr
    assert "deprecated" not in current.stderr
    previous = cli(command, *others, old, value)
    assert previous.exit_code == 2 and refusal in previous.stderr  # the same option's value
    assert f"warning: {old} is deprecated; use " in previous.stderr
    both = cli(command, *others, new, value, old, value)
    assert both.exit_code == 2 and "only" in both.stderr
    shown = cli(command, "--help")
    assert new in shown.stdout and f"{old} " not in shown.stdout.replace(f"{old}-", "")


def test_memory_counts_at_the_prompt_tokens_under_either_spelling(cli) -> None:
    """memory's new spellings give the report the old ones gave, without a warning."""
    current = cli("memory", "--prompt-tokens", "8", "--engine", "standard", "-o", "json")
    assert current.exit_code == 0 and current.stderr == "", current.output
    previous = cli("memory", "--tokens", "8", "--engines", "standard", "-o", "json")
    assert previous.exit_code == 0, previous.output
    assert "--tokens is deprecated" in previous.stderr
    assert "--engines is deprecated" in previous.stderr
    assert json.loads(current.stdout) == json.loads(previous.stdout)
    (row,) = json.loads(current.stdout)["engines"]
    assert row["engine"] == "standard" and row["positions"] == 8
    missing = cli("memory")
    assert missing.exit_code == 2 and "give --prompt-tokens N" in missing.stderr


def test_output_format_speaks_text_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert output_format("text", ("text", "json")) == "text"
    assert output_format("json", ("text", "json")) == "json"
    assert capsys.readouterr().err == ""
    assert output_format("table", ("text", "json")) == "text"
    assert "warning: --output table is deprecated; use --output text" in capsys.readouterr().err
    with pytest.raises(InvalidInput, match="unknown --output 'yaml'; accepted: text, json"):
        output_format("yaml", ("text", "json"))


OUTPUT_COMMANDS = [
    # (command line before --output, what --output accepts)
    (["run", "Hello"], "text, json"),
    (["walk", "Hello"], "text, json"),
    (["bench"], "text, json"),
    (["accuracy"], "text, json"),
    (["memory", "--prompt-tokens", "8"], "text, json"),
    (["engines"], "text, json, markdown"),
    (["models"], "text, json"),
    (["boundary", "ls", "."], "text, json"),
]


@pytest.mark.parametrize("command, accepted", OUTPUT_COMMANDS, ids=lambda c: " ".join(c))
def test_every_output_option_speaks_one_vocabulary(cli, command: list[str], accepted: str) -> None:
    refused = cli(*command, "--output", "yaml")
    assert refused.exit_code == 2
    assert f"unknown --output 'yaml'; accepted: {accepted}" in refused.stderr
    shown = cli(*command[: 2 if command[0] == "boundary" else 1], "--help").stdout
    assert "text" in shown and "table or json" not in shown


@pytest.mark.parametrize("command", [["engines"], ["models"]])
def test_output_table_is_the_old_name_of_text(cli, command: list[str]) -> None:
    text = cli(*command, "--output", "text")
    assert text.exit_code == 0 and "deprecated" not in text.stderr
    table = cli(*command, "--output", "table")
    assert table.exit_code == 0 and table.stdout == text.stdout
    assert "warning: --output table is deprecated; use --output text" in table.stderr
    assert cli(*command).stdout == text.stdout  # text is the default


def test_top_k_is_sampling_only(cli) -> None:
    """walk's features-kept option is -k/--features now; --top-k means sampling (run)."""
    helps = {command: cli(command, "--help").stdout for command in ("run", "walk", "bench")}
    assert "--top-k" in helps["run"]
    assert "--top-k" not in helps["walk"] and "--features" in helps["walk"]


@pytest.mark.parametrize("command", ["run", "walk", "serve", "bench", "accuracy", "apollo"])
def test_every_model_loading_command_takes_threads(cli, command: str, tmp_path: Path) -> None:
    others = {"run": ["Hello"], "walk": ["Hello"]}.get(command, [])
    if command == "apollo":
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("A short corpus.")
        others = ["build-store", "--corpus", str(corpus), "--out", str(tmp_path / "store")]
    refused = cli(command, *others, "--threads", "0")
    assert refused.exit_code == 2 and "--threads must be ≥ 1, got 0" in refused.stderr


@pytest.mark.parametrize(
    "command", ["run", "walk", "serve", "bench", "accuracy", "engines", "models"]
)
def test_every_command_that_runs_or_lists_has_verbose(cli, command: str) -> None:
    shown = cli(command, "--help").stdout
    assert "-v" in shown and "--verbose" in shown


def test_models_verbose_adds_each_description(cli) -> None:
    from larql.models.registry import KNOWN_MODELS

    plain, verbose = cli("models").stdout, cli("models", "-v").stdout
    assert "description" in verbose and "description" not in plain
    for known in KNOWN_MODELS.values():  # a table wraps between words, never inside one
        assert all(word in verbose for word in known.description.split()), known.name


@pytest.mark.slow
def test_walk_verbose_names_what_ran(cli) -> None:
    done = cli("walk", "The capital of France is", "--predict", "-n", "2", "-v", "-o", "json")
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)
    assert data["decode_path"].startswith("cpu · float32 · ") and len(data["token_ids"]) == 2
    assert f"decode path: {data['decode_path']}" in done.stderr
    assert "engine: standard" in done.stderr and "prompt tokens: 5" in done.stderr


@pytest.mark.slow
def test_bench_verbose_names_each_rows_decode_path(cli) -> None:
    args = ["bench", "--engine", "standard", "--prompt-tokens", "4", "-n", "2", "--repeats", "1"]
    done = cli(*args, "--warmup", "0", "-q", "-v", "-o", "json")
    assert done.exit_code == 0, done.output
    (row,) = json.loads(done.stdout)["rows"]
    assert f"{row['label']} @ depth 4: decode path: {row['decode_path']}" in done.stderr
    assert "note: " in done.stderr


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
