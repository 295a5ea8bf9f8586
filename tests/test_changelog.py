"""CHANGELOG.md in Keep a Changelog's form, its top entry the version `larql --version` prints and
pyproject.toml declares."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from datetime import date
from pathlib import Path

import larql

ROOT = Path(__file__).resolve().parents[1]
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()
ENTRY = re.compile(r"^## \[(\d+)\.(\d+)\.(\d+)\] - (\d{4}-\d{2}-\d{2})$", re.MULTILINE)
KINDS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def entries() -> list[tuple[tuple[int, int, int], date]]:
    """(version, date) of every entry, top first."""
    return [
        ((int(major), int(minor), int(patch)), date.fromisoformat(day))
        for major, minor, patch, day in ENTRY.findall(CHANGELOG)
    ]


def top_version() -> str:
    return ".".join(map(str, entries()[0][0]))


def test_larql_version_is_the_top_entry() -> None:
    larql_bin = Path(sys.executable).with_name("larql")
    shown = subprocess.run([str(larql_bin), "--version"], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == f"larql {top_version()}"


def test_the_package_declares_the_top_entry() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert declared == larql.__version__ == top_version()


def test_entries_newest_first_with_known_kinds() -> None:
    found = entries()
    assert found, "no `## [X.Y.Z] - YYYY-MM-DD` entry"
    versions = [version for version, _ in found]
    days = [day for _, day in found]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)
    assert days == sorted(days, reverse=True)
    kinds = set(re.findall(r"^### (.+)$", CHANGELOG, re.MULTILINE))
    assert kinds <= KINDS, kinds - KINDS
