"""Tables never split a number or a word across lines: bench's, accuracy's and `larql engines`'
at any terminal width (columns are left out, and named, where the terminal is too narrow);
`larql engines` is compact by default, the full catalog behind `-v`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from rich.table import Table

from larql.cli.catalog_cmd import spelling_variants
from larql.harness.accuracy.fidelity import Fidelity
from larql.harness.accuracy.report import fidelity_table
from larql.harness.bench.engine_bench import EngineRow
from larql.harness.bench.report import render_table
from larql.harness.bench.run import BenchReport
from larql.harness.bench.stats import StepStats
from larql.harness.formatting import Unbroken, shared_out
from larql.inference.memory import MemoryBreakdown
from larql.kv.catalog import CATALOG

LARQL = Path(sys.executable).with_name("larql")


def printed(renderable: object, width: int) -> list[str]:
    console = Console(width=width, record=True, markup=False, highlight=False)
    console.print(renderable)
    return console.export_text().splitlines()


def cell_texts(line: str) -> list[str]:
    """The cells of one table line, between the box's vertical rules."""
    return [cell.strip() for cell in line.replace("┃", "│").split("│")]


def split_words(words: set[str], lines: list[str]) -> list[str]:
    """The words that no cell of any line holds whole."""
    held = {word for line in lines for cell in cell_texts(line) for word in cell.split()}
    return sorted(words - held)


def words_of(*texts: str) -> set[str]:
    return {word for text in texts for word in text.split()}


FIGURES = st.floats(min_value=1e-9, max_value=1e6, allow_nan=False)


@settings(max_examples=25, deadline=None)
@given(
    width=st.integers(min_value=80, max_value=220),
    figures=st.lists(FIGURES, min_size=12, max_size=12),
)
def test_fidelity_numbers_are_never_split(width: int, figures: list[float]) -> None:
    a, b, c, d, e, f, g, h, i, j, k, m = figures
    rows = [
        Fidelity("turbo-quant:bits=4", 128, a, b, c, d, 0.714, e, f, 2**20, 0, 0.27, 7, 32),
        Fidelity("snapkv:budget=256,window=32", 64, g, h, i, j, 1.0, k, -m, 3 * 2**20, 0),
        Fidelity("kv-quant", 128, a, b, c, d, 0.5, e, f, 1, 0, error="BackendUnavailable: x"),
    ]
    table = fidelity_table(rows, "the shipped text")
    lines = printed(table, width)
    assert all(len(line) <= width for line in lines)
    shown_columns = set(cell_texts(next(line for line in lines if "strategy" in line)))
    numbers = {format(x, ".2e") for x in (a, b, c, d, e, g, h, i, j, k)}
    if "mean KL" in shown_columns:
        assert not split_words({format(a, ".2e"), format(g, ".2e")}, lines)
    assert not split_words({"turbo-quant:bits=4", "snapkv:budget=256,window=32"}, lines)
    assert not split_words({"BackendUnavailable:"}, lines)  # the error row's note is kept
    if "same top-1" in shown_columns:
        assert not split_words({"71.4%", "100.0%"}, lines)
    left_out = [col for col in ("cos", "MRR", "JS", "max") if col not in shown_columns]
    if left_out:  # the columns left out are named
        assert any(f"left out at {width} columns" in line for line in lines)
    if width >= 220:
        assert not split_words(numbers, lines)


@settings(max_examples=25, deadline=None)
@given(
    width=st.integers(min_value=80, max_value=200),
    times=st.lists(st.floats(min_value=0.01, max_value=9999), min_size=5, max_size=5),
)
def test_bench_numbers_are_never_split(width: int, times: list[float]) -> None:
    mib = 2**20
    mean, p50, p99, fwd, head = times
    row = EngineRow(
        spec="markov-rs:window=64",
        label="markov-rs",
        depth=0,
        prompt_tokens=128,
        prefill_ms=fwd * 10,
        step=StepStats(mean, p50, p99, 32),
        fwd_ms=fwd,
        head_ms=head,
        tok_s=1000 / mean,
        tok_s_runs=[1000 / p99, 1000 / p50],
        memory=MemoryBreakdown(hot=38 * mib, cold=mib // 3, derivative=19 * mib, reserved=mib),
        context_tokens=160,
        fp16_full_bytes=7 * mib,
        weight_read_bytes=10**8,
        bandwidth_gbs=10.0,
    )
    meta = {
        "model": "smollm2-135m",
        "dtype": "float32",
        "device": "cpu",
        "threads": 2,
        "new_tokens": 32,
        "repeats": 3,
        "warmup": 3,
        "copy_bandwidth_gbs": 10.0,
        "method": "whole tokens, wall clock",
    }
    failed = EngineRow("turbo-quant", "turbo-quant", 0, 128, error="BackendUnavailable: no cuda")
    lines = printed(render_table(BenchReport(meta, [row, failed])), width)
    assert all(len(line) <= width for line in lines)
    words = {
        "markov-rs:window=64",
        f"{1000 / mean:.1f}",  # tok/s, never dropped
        "38.00/0.33/19.00",  # MiB hot/cold/deriv, never dropped
        "BackendUnavailable:",  # an error row's message, in the tok/s column
    }
    assert not split_words(words, lines)
    header = next(line for line in lines if "engine" in line)
    if "ms/tok" in header:
        assert not split_words({f"{mean:.2f}", f"{p50:.2f}", f"{p99:.2f}"}, lines)


@settings(max_examples=40, deadline=None)
@given(
    spare=st.integers(min_value=0, max_value=300),
    needs=st.lists(st.integers(min_value=0, max_value=80), min_size=1, max_size=12),
)
def test_the_spare_width_is_shared_within_each_columns_need(spare: int, needs: list[int]) -> None:
    given_out = shared_out(spare, needs)
    assert all(0 <= g <= n for g, n in zip(given_out, needs, strict=True))
    assert sum(given_out) == min(spare, sum(needs))  # nothing wasted while a column is short
    if spare >= len(needs) * max(needs):
        assert given_out == needs


def test_a_table_too_narrow_even_so_cuts_no_line() -> None:
    """Below the longest words of the columns left, rich folds, but every character prints."""
    table = Table()
    for name in ("a", "b"):
        table.add_column(name)
    table.add_row("1234567890123", "abcdefghijklmn")
    text = "".join("".join(line.split()) for line in printed(Unbroken(table), 20))
    for ch in "1234567890123abcdefghijklmn":
        assert ch in text


def engines_at(width: int, *args: str) -> list[str]:
    """`larql engines ARGS` as a terminal of `width` columns shows it."""
    import io

    from typer.testing import CliRunner

    from larql.cli import catalog_cmd
    from larql.cli.app import app

    shown = io.StringIO()
    terminal = Console(file=shown, width=width, highlight=False, markup=False)
    original = catalog_cmd.stdout
    catalog_cmd.stdout = terminal
    try:
        done = CliRunner().invoke(app, ["engines", *args])
    finally:
        catalog_cmd.stdout = original
    assert done.exit_code == 0, done.output
    return (shown.getvalue() + done.stdout).splitlines()


def test_engines_is_compact_and_whole_at_80_columns() -> None:
    lines = engines_at(80)
    assert all(len(line) <= 80 for line in lines)
    assert len(lines) <= 3 * len(CATALOG.entries) + 8  # a few lines an engine, not hundreds
    words = words_of(*(e.name for e in CATALOG.entries), *(e.summary for e in CATALOG.entries))
    assert not split_words(words, lines)
    assert not any("contract" in line for line in lines[:-1])  # that is -v's


def test_engines_verbose_is_the_full_catalog_whole_at_80_columns() -> None:
    lines = engines_at(80, "-v")
    assert all(len(line) <= 80 for line in lines)
    words = words_of(*(f"{e.keeps} {e.contract} {', '.join(e.aliases)}" for e in CATALOG.entries))
    assert not split_words(words, lines)


def test_every_engine_says_what_it_is_for_in_one_short_line() -> None:
    for e in CATALOG.entries:
        assert e.purpose and "\n" not in e.purpose and len(e.purpose) <= 40, e.name
    rows = json.loads("\n".join(engines_at(80, "--output", "json")))
    assert [r["purpose"] for r in rows] == [e.summary for e in CATALOG.entries]


def test_the_compact_aliases_leave_out_spelling_variants() -> None:
    aliases = ("markov_rs", "markov-residual", "markov_residual")
    assert spelling_variants("markov-rs", aliases) == ["markov-residual"]
    assert spelling_variants("no-cache", ("no_cache", "none", "off")) == ["none", "off"]
    assert spelling_variants("kv-quant", ("kv_quant", "kivi")) == ["kivi"]
