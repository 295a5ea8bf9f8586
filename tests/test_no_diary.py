"""The project speaks of itself as it is: no README, doc, source, test or benchmark line names a
work period or an issue number (what changed over time is in CHANGELOG.md and git)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Written so that this file's own lines do not match it: `\s` and `[(]` where the words meet.
ORDINAL = (
    r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    r"[a-z]+teenth|twentieth|thirtieth|fortieth|(twenty|thirty|forty)-[a-z]+"
)
DIARY = re.compile(
    rf"\b({ORDINAL})\s+session|\bissues?\s+#?\d+|[(]session\b|session's\send|this\ssession|"
    r"last\ssession|earlier\ssessions",
    re.IGNORECASE,
)
PATTERNS = (
    "README.md",
    "docs/**/*.md",
    "src/**/*.py",
    "src/**/*.cpp",
    "src/**/*.h",
    "src/**/*.cu",
    "tests/**/*.py",
    "benchmarks/**/*",
)


def project_files() -> list[Path]:
    found = {p for pattern in PATTERNS for p in ROOT.glob(pattern)}
    return sorted(p for p in found if p.is_file() and "__pycache__" not in p.parts)


def diary_lines(path: Path) -> list[str]:
    text = path.read_text(errors="replace")
    rel = path.relative_to(ROOT)
    return [
        f"{rel}:{i}: {line.strip()}"
        for i, line in enumerate(text.splitlines(), 1)
        if DIARY.search(line)
    ]


def test_the_pattern_catches_what_it_is_for() -> None:
    # each sample in two parts, so that this file does not hold the lines it forbids
    parts = [
        ("as the twenty-third ", "session measured"),
        ("see issue ", "16"),
        ("issues ", "#3 and #4"),
        ("(", "session 12) moved it"),
        ("at this ", "session", "'s end"),
        ("since the last ", "session"),
    ]
    caught = ["".join(p) for p in parts]
    kept = [
        "one program per (sequence, K/V head)",
        "the session's first token",
        "a stream's events",
        "token = prefill(gen)",
    ]
    assert all(DIARY.search(line) for line in caught)
    assert not any(DIARY.search(line) for line in kept)


def test_no_work_diary_or_issue_numbers_in_the_project() -> None:
    files = project_files()
    assert any(p.name == "README.md" for p in files) and any(p.suffix == ".cu" for p in files)
    hits = [hit for path in files for hit in diary_lines(path)]
    assert not hits, "\n".join(hits[:20])
