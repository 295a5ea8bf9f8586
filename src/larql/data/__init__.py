"""Texts shipped with larql so measurements run offline and are reproducible.

`apache-2.0.txt` is the Apache License 2.0 (~2,200 SmolLM2 tokens of real English): the default
text for bench contexts and teacher-forced fidelity.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from larql.errors import LarqlError

DEFAULT_TEXT_NAME = "apache-2.0.txt"


def default_text() -> str:
    return files(__package__).joinpath(DEFAULT_TEXT_NAME).read_text(encoding="utf-8")


def default_text_label() -> str:
    return f"Apache License 2.0 text (larql/data/{DEFAULT_TEXT_NAME})"


def read_text(path: str | Path | None) -> tuple[str, str]:
    """(text, label): the file at `path`, or the shipped default text."""
    if path is None:
        return default_text(), default_text_label()
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8"), str(p)
    except (OSError, UnicodeDecodeError) as e:
        raise LarqlError(f"cannot read text file {p}: {e}") from None
