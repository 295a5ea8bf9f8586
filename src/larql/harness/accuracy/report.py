"""Rendering an accuracy report: the split table, served-rate lines, and the fidelity table."""

from __future__ import annotations

import math

from rich.table import Table

from larql.harness.accuracy.fidelity import Fidelity
from larql.inference.memory import mib_value


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def fidelity_table(rows: list[Fidelity], text_label: str) -> Table:
    table = Table(
        title=f"Teacher-forced fidelity vs standard (full cache) — {text_label}",
        caption="KL(standard‖engine) in nats per position; Δp = change in p(true next token); "
        "ln PPL ratio = ln(PPL(engine)/PPL(standard)); divergence = first greedy step that differs",
        caption_justify="left",
    )
    for col in ("strategy", "positions", "mean KL", "median", "p99", "max", "same top-1",
                "Δp RMS", "ln PPL ratio", "greedy divergence", "state MiB", "note"):  # fmt: skip
        if col == "strategy":  # never broken inside: a spec has to stay pasteable
            widest = max([len(r.spec) for r in rows] + [len(col)])
            table.add_column(col, no_wrap=True, min_width=widest)
            continue
        table.add_column(col, justify="left" if col == "note" else "right", overflow="fold")
    for r in rows:
        if r.error:
            table.add_row(r.spec, *[""] * 10, f"error: {r.error}")
            continue
        divergence = (
            "—" if not r.greedy_steps
            else f"none in {r.greedy_steps}" if r.first_divergence is None
            else f"step {r.first_divergence}"
        )  # fmt: skip
        table.add_row(
            r.spec,
            str(r.positions),
            _f(r.mean_kl, ".2e"),
            _f(r.median_kl, ".2e"),
            _f(r.p99_kl, ".2e"),
            _f(r.max_kl, ".2e"),
            _f(r.same_top1 * 100, ".1f") + "%",
            _f(r.delta_p_rms, ".2e"),
            _f(r.ln_ppl_ratio, "+.2e"),
            divergence,
            _f(mib_value(r.memory_bytes), ".2f"),
            r.note,
        )
    return table
