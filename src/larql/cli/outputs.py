"""Files a command writes (`--output-file`, `--plot`): checked before the work that fills them,
so a long run does not end at a path that cannot be written, and written with the OS's errors
turned into a typed one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from larql.errors import InvalidInput


def check_output_file(path: Path | None, option: str) -> None:
    """Refuse a path that names a directory, or whose directory is missing or not writable."""
    if path is None:
        return
    if path.is_dir():
        raise InvalidInput(f"{option} {path} is a directory; name a file")
    directory = path.parent
    if not directory.is_dir():
        raise InvalidInput(f"{option} {path}: no directory {directory} to write it in")
    if not os.access(directory, os.W_OK):
        raise InvalidInput(f"{option} {path}: the directory {directory} is not writable")


def plot_formats() -> list[str]:
    """The file name suffixes matplotlib draws to (png, pdf, svg, …)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def check_plot_file(path: Path | None, option: str = "--plot") -> None:
    """`check_output_file`, and a suffix matplotlib draws to (none: PNG, `.png` added)."""
    if path is None:
        return
    check_output_file(path, option)
    suffix = path.suffix.removeprefix(".").lower()
    if suffix and suffix not in (formats := plot_formats()):
        raise InvalidInput(
            f"{option} {path}: no plot format {suffix!r}; accepted: {', '.join(formats)}"
        )


@contextmanager
def writing(path: Path, option: str) -> Iterator[None]:
    """Runs the write of `path`; an OS error (disk full, permissions changed since the check)
    becomes an `InvalidInput` naming the option and the path."""
    try:
        yield
    except OSError as e:
        raise InvalidInput(f"cannot write {option} {path}: {e.strerror or e}") from None


def write_text(path: Path, text: str, option: str) -> None:
    with writing(path, option):
        path.write_text(text)
