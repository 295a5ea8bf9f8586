"""The README is a map of what exists: short, its two set-up commands, every command named, its
engine table naming real engines, its links leading somewhere. The catalog's every engine, alias
and parameter are held in docs/ENGINES.md (tests/test_cli_docs.py), every command's options in
docs/CLI.md."""

from __future__ import annotations

import re
from pathlib import Path

from larql.cli.app import app
from larql.kv import CATALOG, parse_engine

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CLI_DOC = (ROOT / "docs" / "CLI.md").read_text()
MAX_WORDS = 1800  # one screen per idea: the README points to the docs for the rest
# the change log comes with the versioned releases; its link is in place before the file
NOT_YET_WRITTEN = {"CHANGELOG.md"}
LINK = re.compile(r"\]\(([^)#]+)(?:#[^)]*)?\)")


def section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_is_short() -> None:
    words = len(re.findall(r"\S+", README))
    assert words <= MAX_WORDS, f"README.md has {words} words; move details into docs/"


def test_quick_start_has_the_two_commands() -> None:
    quick_start = section(README, "Quick start")
    assert "make run" in quick_start and "make test" in quick_start


def test_every_command_is_documented() -> None:
    names = [c.name or c.callback.__name__ for c in app.registered_commands]
    names += [g.name for g in app.registered_groups]
    for name in names:
        assert f"larql {name}" in README, f"README does not name `larql {name}`"
        assert f"## `larql {name}" in CLI_DOC, f"docs/CLI.md has no section for `larql {name}`"


def test_the_engine_table_names_real_engines() -> None:
    """Each row's first cell is a spec (or an engine name followed by its variants) that parses,
    so a renamed engine or parameter cannot linger in the README."""
    table = section(README, "Which engine for what")
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) >= 10
    named = set()
    for row in rows:
        spec = row.split("|")[1].strip().split("`")[1]
        named.add(parse_engine(spec).entry.name)
    builtin = {e.name for e in CATALOG.entries if e.plugin is None}
    assert named <= builtin
    assert {"standard", "turbo-quant", "kv-quant", "markov-rs", "no-cache"} <= named


def test_the_readme_links_lead_somewhere() -> None:
    targets = LINK.findall(README)
    assert "docs/ENGINES.md" in targets and "docs/CLI.md" in targets
    for target in targets:
        if target.startswith("http") or target in NOT_YET_WRITTEN:
            continue
        assert (ROOT / target).exists(), f"README links to missing {target}"
