"""Rendering a bench report: a rich table, JSON, and a PNG of tok/s and memory vs depth."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table
from rich.text import Text

from larql.harness.bench.run import BenchReport
from larql.harness.formatting import Unbroken, shown
from larql.inference.memory import mib_value


def _mib(n: int | None) -> str:
    return "—" if not n else f"{mib_value(n):.2f}"


# At a narrow terminal the columns go in this order, the least telling first.
MAIN_DROP = (
    "× HF",
    "GB/s (share)",
    "fwd/head ms",
    "B/token",
    "peak working MiB",
    "prefill ms",
    "ms/tok mean p50 p99",
    "× fp16 full",
    "context",
)


def render_table(report: BenchReport) -> Unbroken:
    meta = report.meta
    title = (
        f"{meta['model']} · {meta['dtype']} · {meta['device']} · {meta['threads']} threads · "
        f"{meta['new_tokens']} tokens × {meta['repeats']} repeats (warmup {meta['warmup']}) · "
        f"copy bandwidth {meta['copy_bandwidth_gbs']:.1f} GB/s"
    )
    table = Table(title=title, caption=meta["method"], caption_justify="left")
    columns = [
        "engine",
        "context",
        "prefill ms",
        "ms/tok mean p50 p99",
        "tok/s (spread)",
        "fwd/head ms",
        "MiB hot/cold/deriv +reserve",
        "B/token",
        "× fp16 full",
        "GB/s (share)",
        "× HF",
    ]
    with_peak = any(row.peak_working_bytes for row in report.rows)
    if with_peak:  # CUDA: the allocator's peak above the resident weights, and what stays held
        columns += ["peak working MiB", "held MiB"]
    table.add_column(columns[0])
    for name in columns[1:]:
        table.add_column(name, justify="right")
    for row in report.rows:
        if row.error:
            blanks = [""] * (len(columns) - 5)
            # a styled cell: the console prints text as given, markup included; in the tok/s
            # column, which a narrow terminal keeps
            error = Text(row.error, style="red")
            table.add_row(row.spec, str(row.prompt_tokens), "", "", error, *blanks)
            continue
        step = row.step
        memory = row.memory
        spread = (
            f"{shown(row.tok_s, '.1f')} ({min(row.tok_s_runs):.1f}–{max(row.tok_s_runs):.1f})"
            if row.tok_s_runs
            else "—"
        )
        gbs = row.achieved_gbs
        share = row.bandwidth_share
        times = " ".join(shown(x, ".2f") for x in (step.mean, step.p50, step.p99)) if step else "—"
        table.add_row(
            row.spec,
            str(row.prompt_tokens),
            shown(row.prefill_ms, ".1f"),
            times,
            spread,
            f"{shown(row.fwd_ms, '.2f')}/{shown(row.head_ms, '.2f')}",
            "/".join(_mib(x) for x in (memory.hot, memory.cold, memory.derivative))
            + f" +{_mib(memory.reserved)}"
            if memory and memory.total
            else "—",
            shown(row.bytes_per_token, ",.0f"),
            shown(row.ratio_vs_fp16_full, ".2f"),
            f"{shown(gbs, '.1f')} ({shown(share * 100 if share else None, '.0f')}%)",
            shown(report.peer_ratio(row), ".2f"),
            *([_mib(row.peak_working_bytes), _mib(row.held_bytes)] if with_peak else []),
        )
    for peer in report.peers.values():
        runs = peer.tok_s_runs
        table.add_row(
            "hf-transformers",
            str(peer.prompt_tokens),
            shown(peer.prefill_ms, ".1f"),
            shown(1000 / peer.tok_s if peer.tok_s else None, ".2f"),
            f"{peer.tok_s:.1f} ({min(runs):.1f}–{max(runs):.1f})" if runs else "—",
            "",
            _mib(peer.cache_bytes),
            "",
            "",
            "",
            "1.00",
            *(["", ""] if with_peak else []),
        )
    return Unbroken(table, MAIN_DROP)


def batch_table(report: BenchReport) -> Unbroken:
    """`--batch`: B sessions of each engine decoding at once."""
    table = Table(
        title="batched decode: B sessions of one engine at once",
        caption="aggregate = B tokens per step; ×B=1 = aggregate over the same engine's one "
        "session; batched = one forward pass per step (else the sessions step in turn), "
        "ahead = each step queued before the one before it was read",
        caption_justify="left",
    )
    columns = [
        "engine",
        "context",
        "B",
        "batched",
        "aggregate tok/s",
        "× B=1",
        "ms/token per stream",
        "MiB per session",
    ]
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    single = {(r.spec, r.depth): r.tok_s for r in report.batch_rows if r.batch == 1}
    for row in report.batch_rows:
        if row.error:
            table.add_row(row.spec, str(row.depth), str(row.batch), "", f"error: {row.error}")
            continue
        base = single.get((row.spec, row.depth))
        ratio = f"{row.tok_s / base:.2f}" if base and row.tok_s else "—"
        table.add_row(
            row.spec,
            str(row.depth),
            str(row.batch),
            ("yes, ahead" if row.ahead else "yes") if row.batched else "no",
            shown(row.tok_s, ".1f"),
            ratio,
            shown(row.ms_per_token, ".2f"),
            _mib(row.memory_per_session),
        )
    return Unbroken(table, ("MiB per session", "ms/token per stream", "batched", "× B=1"))


def concurrent_table(report: BenchReport) -> Unbroken:
    """`--concurrent N`: N sessions of each engine on N threads, each stepping alone."""
    table = Table(
        title="concurrent sessions: N engines decoding at once, one thread each, no batching",
        caption="aggregate = every thread's tokens over the slowest thread's time; ms/token: "
        "the threads' median",
        caption_justify="left",
    )
    for i, name in enumerate(("engine", "context", "N", "aggregate tok/s", "ms/token per stream")):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in report.concurrent_rows:
        if row.error:
            table.add_row(row.spec, str(row.depth), str(row.concurrent), f"error: {row.error}")
            continue
        table.add_row(
            row.spec,
            str(row.depth),
            str(row.concurrent),
            shown(row.tok_s, ".1f"),
            shown(row.ms_per_token, ".2f"),
        )
    return Unbroken(table, ("ms/token per stream",))


def prefix_table(report: BenchReport) -> Unbroken:
    """`--shared-prefix N`: a second question about a document, from the prefix cache."""
    table = Table(
        title="prefix cache: a second question about the same document",
        caption="time to first token (prefill + first pick), medians over rounds; cold: the "
        "first question, all computed; warm: the second, from the cached document; copy: the "
        "cache taking the state",
        caption_justify="left",
    )
    columns = ("engine", "shared", "cold ms", "warm ms", "× faster", "copy ms", "cached MiB")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in report.prefix_rows:
        if row.error:
            table.add_row(row.spec, str(row.shared_tokens), f"error: {row.error}")
            continue
        table.add_row(
            row.spec,
            str(row.cached_tokens if row.cached_tokens is not None else row.shared_tokens),
            shown(row.cold_ms, ".1f"),
            shown(row.warm_ms, ".1f"),
            shown(row.speedup, ".1f"),
            shown(row.store_ms, ".1f"),
            _mib(row.cache_bytes),
        )
    return Unbroken(table, ("cold ms", "warm ms", "cached MiB"))


def stage_tables(report: BenchReport) -> list[Unbroken]:
    tables = []
    for row in report.rows:
        if not row.stages:
            continue
        total = row.stages.get("total (measured)", 0.0)
        table = Table(title=f"Stage breakdown ({row.label}, depth {row.depth}, µs per step)")
        table.add_column("stage")
        table.add_column("µs", justify="right")
        table.add_column("share", justify="right")
        for stage, us in row.stages.items():
            table.add_row(stage, f"{us:.1f}", f"{100 * us / total:.1f}%" if total else "0.0%")
        tables.append(Unbroken(table))
    return tables


def save_plot(report: BenchReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(12, 4.5))
    specs = list(dict.fromkeys(r.spec for r in report.rows))
    for spec in specs:
        rows = sorted(
            (r for r in report.rows if r.spec == spec and not r.error), key=lambda r: r.depth
        )
        if not rows:
            continue
        depths = [r.prompt_tokens for r in rows]
        speed.plot(depths, [r.tok_s or 0 for r in rows], marker="o", label=spec)
        memory.plot(
            depths,
            [mib_value(r.memory.state if r.memory else 0) for r in rows],
            marker="o",
            label=spec,
        )
    if report.peers:
        peers = sorted(report.peers.items())
        speed.plot(
            [p.prompt_tokens for _, p in peers],
            [p.tok_s for _, p in peers],
            "k--",
            marker="s",
            label="hf-transformers",
        )
    speed.set(xlabel="context tokens", ylabel="decode tok/s", title="decode speed vs depth")
    memory.set(xlabel="context tokens", ylabel="engine state (MiB)", title="memory vs depth")
    for ax in (speed, memory):
        ax.grid(alpha=0.3)
    speed.legend(fontsize=7)
    fig.suptitle(f"{report.meta['model']} · {report.meta['dtype']} · {report.meta['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
