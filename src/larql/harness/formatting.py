"""How the bench and accuracy tables print: a number formatted, or "—" where nothing was
measured (None or NaN), never a made-up zero; and a table laid out so that no number or word is
split across lines at any terminal width."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text


def shown(value: float | None, fmt: str, missing: str = "—") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, fmt)


class Unbroken:
    """A rich table printed so that no number or word is ever split across lines: each column
    is at least as wide as its longest word (cells and header wrap only at spaces), and where
    the console is too narrow for every column, the columns named in `drop` (in that order,
    the least telling first) are left out and the caption names them. Only a console narrower
    than the longest words of the columns left splits words (rich's own layout)."""

    def __init__(self, table: Table, drop: Sequence[str] = ()) -> None:
        self.table = table
        self.drop = list(drop)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield fitted(self.table, options.max_width, console, options, self.drop)


def _header(column: Column) -> str:
    header = column.header
    return header.plain if isinstance(header, Text) else str(header)


def _spans(column: Column, console: Console, options: ConsoleOptions) -> tuple[int, int]:
    """(longest word, longest line) over the header and the cells, in cells of the console."""
    least, whole = 0, 0
    for cell in [column.header, *column.cells]:
        measured = Measurement.get(console, options, cell)
        least, whole = max(least, measured.minimum), max(whole, measured.maximum)
    return least, whole


def shared_out(spare: int, needs: list[int]) -> list[int]:
    """`spare` cells shared among columns short of their longest line by `needs`: the columns
    that an equal share makes whole get what they need (numbers on one line), in rounds; the
    rest goes to the columns still short from the left (the first the most telling). Never
    more than a column needs."""
    given = [0] * len(needs)
    short = [i for i, need in enumerate(needs) if need > 0]
    while short and spare > 0:
        share = spare // len(short)
        whole = [i for i in short if needs[i] <= share]
        if not whole:
            for i in short:
                given[i] = min(needs[i], spare)
                spare -= given[i]
            break
        for i in whole:
            given[i] = needs[i]
            spare -= needs[i]
        short = [i for i in short if i not in whole]
    return given


def fitted(
    table: Table,
    width: int,
    console: Console,
    options: ConsoleOptions,
    drop: Sequence[str] = (),
) -> Table:
    """A copy of `table` whose columns have fixed widths that fit `width` with no word split,
    the columns of `drop` left out (and named in the caption) until the rest fits."""
    unbounded = options.update(width=10**6)
    columns = list(table.columns)
    spans = {id(c): _spans(c, console, unbounded) for c in columns}
    padding = table.padding[1] + table.padding[3]

    def rules(kept: list[Column]) -> int:  # the vertical lines of the box
        return ((2 if table.show_edge else 0) + len(kept) - 1) if table.box else 0

    def least_total(kept: list[Column]) -> int:
        return sum(spans[id(c)][0] + padding for c in kept) + rules(kept)

    left_out: list[str] = []
    for name in drop:
        if least_total(columns) <= width:
            break
        for column in columns:
            if _header(column) == name:
                columns.remove(column)
                left_out.append(name)
                break
    laid_out = copy.copy(table)
    spare = width - least_total(columns)
    if spare >= 0:
        needs = [spans[id(c)][1] - spans[id(c)][0] for c in columns]
        extras = shared_out(spare, needs)
        widths = [spans[id(c)][0] + extra for c, extra in zip(columns, extras, strict=True)]
        # fixed widths, which rich does not squeeze; "fold" is never reached, since no word is
        # wider than its column
        laid_out.columns = [
            dataclasses.replace(column, width=content, no_wrap=False, overflow="fold")
            for column, content in zip(columns, widths, strict=True)
        ]
    else:  # too narrow even so: rich's layout, folding what it must, no line cut off
        laid_out.columns = [
            dataclasses.replace(column, no_wrap=False, overflow="fold") for column in columns
        ]
    if left_out:
        note = f"left out at {width} columns: {', '.join(left_out)} (a wider terminal shows them)"
        caption = table.caption
        laid_out.caption = note if caption is None else f"{caption}\n{note}"
    return laid_out
