"""docs/CLI.md and docs/ENGINES.md describe the CLI and the catalog as they are: every command and
every option of the typer app has its place in docs/CLI.md, every environment variable larql
reads is listed there, and docs/ENGINES.md is exactly what `larql engines --output markdown`
prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from larql.cli.app import app
from larql.cli.catalog_markdown import catalog_markdown
from larql.cli.common import EXIT_USER_ERROR
from larql.kv import CATALOG
from larql.kv.plugins import DISABLE_VAR

ROOT = Path(__file__).resolve().parents[1]
CLI_DOC = (ROOT / "docs" / "CLI.md").read_text()
ENGINES_DOC = ROOT / "docs" / "ENGINES.md"
CODE_SPAN = re.compile(r"`([^`]+)`")
FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
# an environment variable larql reads: `os.environ.get("X")`, `os.environ["X"]`, `getenv("X")`,
# `"X" in os.environ`, or a module constant `…_VAR = "X"` read that way
READ_VAR = re.compile(
    r"""(?:environ(?:\.get)?\(|environ\[|getenv\(|_VAR\s*=\s*)["'](LARQL_[A-Z0-9_]+)["']"""
    r"""|["'](LARQL_[A-Z0-9_]+)["']\s+in\s+os\.environ"""
)


def builtin_entries():
    return [e for e in CATALOG.entries if e.plugin is None]  # plugins depend on the machine


def commands() -> Iterator[tuple[str, Any]]:
    """('larql run', its click command), … for every command and group subcommand (typer
    builds them on its own copy of click, so they are read by attribute, not by class)."""

    def walk(command: Any, path: str) -> Iterator[tuple[str, Any]]:
        subcommands = getattr(command, "commands", {})
        if not subcommands:
            yield path, command
        for name, sub in subcommands.items():
            yield from walk(sub, f"{path} {name}")

    yield from walk(typer.main.get_command(app), "larql")


def section(doc: str, command: str) -> str:
    """The text under the `## \\`command\\` — …` heading, up to the next `## ` heading."""
    heading = re.search(rf"^## `{re.escape(command)}`.*$", doc, re.MULTILINE)
    assert heading is not None, f"docs/CLI.md has no section for `{command}`"
    rest = doc[heading.end() :]
    end = re.search(r"^## ", rest, re.MULTILINE)
    return rest[: end.start()] if end else rest


def spelled(name: str, text: str) -> bool:
    """Whether `name` (an option such as -n or --top-k) appears in a code span of `text` as
    itself, not inside a longer option; an example's use does not count."""
    pattern = re.compile(rf"(?<![\w-]){re.escape(name)}(?![\w-])")
    return any(pattern.search(span) for span in CODE_SPAN.findall(FENCED.sub("", text)))


COMMANDS = list(commands())


@pytest.mark.parametrize("path, command", COMMANDS, ids=[p for p, _ in COMMANDS])
def test_every_option_of_every_command_is_in_the_cli_doc(path: str, command: Any):
    text = section(CLI_DOC, path)
    for param in command.params:
        if param.param_type_name == "argument":
            names = [(param.metavar or param.name or "").upper()]
        else:
            names = [*param.opts, *param.secondary_opts]
        for name in names:
            assert spelled(name, text), f"docs/CLI.md, `{path}`, does not document {name}"


def test_the_top_level_options_are_in_the_cli_doc() -> None:
    for param in typer.main.get_command(app).params:
        for name in param.opts:
            assert spelled(name, CLI_DOC), name


def test_the_cli_doc_lists_every_environment_variable_larql_reads() -> None:
    sources = [*(ROOT / "src").rglob("*.py"), *(ROOT / "src").rglob("*.h")]
    sources += [*(ROOT / "src").rglob("*.cpp"), ROOT / "tests" / "conftest.py"]
    read = {m.group(1) or m.group(2) for f in sources for m in READ_VAR.finditer(f.read_text())}
    assert {"LARQL_KV_ENGINE", "LARQL_CACHE_DIR", DISABLE_VAR} <= read  # the pattern finds them
    table = CLI_DOC.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    for variable in sorted(read):
        assert f"| `{variable}` |" in table, f"docs/CLI.md does not list {variable}"


def test_the_cli_doc_states_the_exit_codes() -> None:
    table = CLI_DOC.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    for code in (0, EXIT_USER_ERROR, 130):
        assert f"| {code} |" in table


def test_the_engines_page_is_the_catalog() -> None:
    page = ENGINES_DOC.read_text()
    assert page == catalog_markdown(builtin_entries()), (
        "docs/ENGINES.md is stale: run `larql engines --output markdown > docs/ENGINES.md`"
    )
    for entry in builtin_entries():
        text = page.split(f"\n## {entry.name}\n", 1)[1].split("\n## ", 1)[0]
        for name in (*entry.aliases, *(f"{p.name}" for p in entry.params)):
            assert f"`{name}`" in text, f"docs/ENGINES.md, {entry.name}, lacks {name}"
        assert " ".join(entry.contract.split()) in text and " ".join(entry.keeps.split()) in text


def test_engines_prints_the_page_in_markdown() -> None:
    result = CliRunner().invoke(app, ["engines", "--output", "markdown"])
    assert result.exit_code == 0, result.output
    assert result.stdout == catalog_markdown(CATALOG.entries)
    refused = CliRunner().invoke(app, ["engines", "--output", "yaml"])
    assert refused.exit_code == EXIT_USER_ERROR and "markdown" in refused.output


@pytest.mark.slow
def test_the_engines_page_is_the_command_output_as_run() -> None:
    """What the acceptance check runs: the console script, with no plugins installed."""
    larql = Path(sys.executable).with_name("larql")
    env = {**os.environ, DISABLE_VAR: "1"}
    done = subprocess.run(
        [str(larql), "engines", "--output", "markdown"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ENGINES_DOC.read_text()
