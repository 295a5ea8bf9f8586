"""The README documents what exists: every engine and alias of the catalog, every command."""

from __future__ import annotations

from pathlib import Path

from larql.cli.app import app
from larql.kv import CATALOG

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_engine_table_lists_every_engine_and_alias() -> None:
    rows = {
        line.split("|")[1].strip(): line for line in README.splitlines() if line.startswith("| `")
    }
    for entry in (e for e in CATALOG.entries if e.plugin is None):  # plugins document themselves
        row = rows.get(f"`{entry.name}`")
        assert row is not None, f"README has no row for {entry.name}"
        for alias in entry.aliases:
            assert f"`{alias}`" in row, f"README row of {entry.name} lacks alias {alias}"
        for param in entry.params:
            assert f"`{param.name}`" in row, f"README row of {entry.name} lacks {param.name}"


def test_quick_start_has_the_two_commands() -> None:
    quick_start = README.split("## Quick start", 1)[1].split("##", 1)[0]
    assert "make run" in quick_start and "make test" in quick_start


def test_every_command_is_documented() -> None:
    names = [c.name or c.callback.__name__ for c in app.registered_commands]
    names += [g.name for g in app.registered_groups]
    for name in names:
        assert f"larql {name}" in README, f"README does not document `larql {name}`"
