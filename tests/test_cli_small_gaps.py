"""The gaps a user meets first: the legacy `--kv-cache markov-bounded` without a window says it
decodes unbounded; `LARQL_*` variables larql does not read are named in one warning; bench's
error rows print no raw markup, its note's memory figures are the table's, and `bench --help`
lists the engines without importing torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from larql.cli.app import app
from larql.cli.engine_names import BUILTIN_ENGINES
from larql.cli.environment import READ_VARIABLES, unread_variables, unread_warning
from larql.harness.bench.engine_bench import EngineRow
from larql.harness.bench.report import render_table
from larql.harness.bench.run import BenchReport
from larql.inference.memory import MemoryBreakdown
from larql.kv.catalog import CATALOG
from larql.kv.resolve import ENV_VAR, resolve_engine
from larql.kv.spec import MalformedEngineSpec
from test_cli_docs import READ_VAR

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ --kv-cache markov-bounded


def test_markov_bounded_without_a_window_warns_naming_the_flag() -> None:
    choice = resolve_engine(None, "markov-bounded", env={})
    assert choice.engine.spec() == "standard"
    (warning,) = choice.warnings
    assert "--context-window" in warning and "unbounded" in warning
    bounded = resolve_engine(None, "markov-bounded", context_window=64, env={})
    assert (bounded.engine.spec(), bounded.warnings) == ("standard:window=64", ())


def test_a_context_window_that_sizes_nothing_is_reported() -> None:
    (alone,) = resolve_engine(None, "standard", context_window=64, env={}).warnings
    assert "--context-window 64 is ignored" in alone
    (beside,) = resolve_engine("no-cache", context_window=64, env={}).warnings
    assert "--context-window 64 is ignored" in beside and "--engine" in beside
    with pytest.raises(MalformedEngineSpec, match="--context-window must be ≥ 0"):
        resolve_engine(None, "markov-bounded", context_window=-1, env={})


def test_run_prints_the_markov_bounded_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    done = CliRunner().invoke(app, ["run", "Hi", "-n", "1", "--kv-cache", "markov-bounded"])
    assert done.exit_code == 0, done.output
    assert "warning: --kv-cache markov-bounded without --context-window" in done.stderr


# ------------------------------------------------------------------ LARQL_* variables


def test_read_variables_are_what_the_sources_read() -> None:
    sources = [*(ROOT / "src").rglob("*.py"), *(ROOT / "src").rglob("*.h")]
    sources += [*(ROOT / "src").rglob("*.cpp"), ROOT / "tests" / "conftest.py"]
    read = {m.group(1) or m.group(2) for f in sources for m in READ_VAR.finditer(f.read_text())}
    assert read == READ_VARIABLES, "update larql/cli/environment.py's READ_VARIABLES"


def test_unread_variables_are_named_in_one_warning() -> None:
    env = {
        "LARQL_SPIN_POOL": "1",
        "LARQL_W10_FAST": "1",
        "LARQL_KV_ENGINE": "standard",
        "LARQL_MARKOV_INPLACE_KV": "1",
        "HOME": "/root",
    }
    assert unread_variables(env) == ["LARQL_MARKOV_INPLACE_KV", "LARQL_SPIN_POOL", "LARQL_W10_FAST"]
    warning = unread_warning(env)
    assert warning is not None and "\n" not in warning
    assert "LARQL_SPIN_POOL" in warning and "does not read" in warning
    assert unread_warning({"LARQL_CACHE_DIR": "/tmp"}) is None


def test_the_command_line_warns_once_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in unread_variables():
        monkeypatch.delenv(name)
    runner = CliRunner()
    quiet = runner.invoke(app, ["models", "--output", "json"])
    assert quiet.exit_code == 0 and "warning" not in quiet.stderr
    env = {"LARQL_SPIN_POOL": "4", "LARQL_W10_ATTN": "1"}
    warned = runner.invoke(app, ["models", "--output", "json"], env=env)
    assert warned.exit_code == 0
    lines = [line for line in warned.stderr.splitlines() if "LARQL_" in line]
    assert len(lines) == 1 and "LARQL_SPIN_POOL" in lines[0] and "LARQL_W10_ATTN" in lines[0]


# ------------------------------------------------------------------ bench's table, note, help


def rendered(report: BenchReport) -> str:
    console = Console(width=400, record=True, markup=False, highlight=False)
    console.print(render_table(report))
    return console.export_text()


META = {
    "model": "m",
    "dtype": "float32",
    "device": "cpu",
    "threads": 1,
    "new_tokens": 2,
    "repeats": 1,
    "warmup": 0,
    "copy_bandwidth_gbs": 10.0,
    "method": "—",
}


def test_an_error_row_prints_its_message_without_markup() -> None:
    row = EngineRow(
        spec="turbo-quant",
        label="x",
        depth=0,
        prompt_tokens=5,
        error="BackendUnavailable: no [cuda] here",
    )
    text = rendered(BenchReport(META, [row]))
    assert "[red]" not in text and "[/]" not in text
    assert "no [cuda] here" in text  # brackets in a message are its own, printed as they are


def test_the_note_gives_the_table_memory_figures() -> None:
    mib = 2**20
    memory = MemoryBreakdown(hot=3 * mib, cold=mib // 2, derivative=2 * mib, reserved=5 * mib)
    row = EngineRow(
        spec="markov-rs",
        label="markov-rs",
        depth=0,
        prompt_tokens=5,
        memory=memory,
        context_tokens=5,
        fp16_full_bytes=mib,
    )
    note = row.note()
    assert "hot=3.00MiB cold=0.50MiB deriv=2.00MiB reserve=5.00MiB" in note
    assert "3.00/0.50/2.00 +5.00" in rendered(BenchReport(META, [row]))
    assert re.search(r"5\.5× vs std-kv$", note)  # the state (hot + cold + derivative) / fp16


def test_the_help_engine_list_is_the_catalog() -> None:
    assert list(BUILTIN_ENGINES) == [e.name for e in CATALOG.entries if e.plugin is None], (
        "update larql/cli/engine_names.py's BUILTIN_ENGINES to the catalog's order"
    )


def test_bench_help_lists_the_engines_without_torch() -> None:
    script = (
        "import sys; from typer.testing import CliRunner; from larql.cli.app import app; "
        "shown = CliRunner().invoke(app, ['bench', '--help'], terminal_width=400); "
        "assert shown.exit_code == 0, shown.output; "
        "assert 'torch' not in sys.modules, 'torch imported'; print(shown.stdout)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    help_text = " ".join(done.stdout.split())
    for name in BUILTIN_ENGINES:
        assert name in help_text
