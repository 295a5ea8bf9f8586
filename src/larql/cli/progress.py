"""Progress of a long command (bench, accuracy) on stderr: a transient bar on a terminal;
where stderr is a file or a pipe (CI, `2> log`, `| tee`), one line per item as it starts (or
finishes), `bench: 2/5 [41 s] markov-rs @ depth 512` (the time since the first), so that a long
run shows it is alive and how far it got. `--quiet`: nothing."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import Progress

from larql.cli.common import stderr

Advance = Callable[[str], None]


@contextmanager
def progress_lines(command: str, total: int | None, quiet: bool = False) -> Iterator[Advance]:
    """Yields `advance(label)`, called as each item starts — or, where items run on several
    processes (`--workers`) or each is done in one go, as each finishes."""
    if quiet:
        yield lambda label: None
        return
    if sys.stderr.isatty():
        with Progress(console=stderr, transient=True) as bar:
            task = bar.add_task(command, total=total)

            def step(label: str) -> None:
                bar.update(task, description=label)
                bar.advance(task)

            yield step
        return
    start = time.perf_counter()
    done = 0

    def line(label: str) -> None:
        nonlocal done
        done += 1
        count = f"{done}/{total}" if total else str(done)
        elapsed = time.perf_counter() - start
        print(f"{command}: {count} [{elapsed:.0f} s] {label}", file=sys.stderr, flush=True)

    yield line
