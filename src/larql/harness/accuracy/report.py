"""Rendering an accuracy report: the split table, served-rate lines, and the fidelity table."""

from __future__ import annotations

from rich.table import Table

from larql.harness.accuracy.fidelity import Fidelity
from larql.harness.formatting import shown
from larql.inference.memory import mib_value


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
            shown(r.mean_kl, ".2e"),
            shown(r.median_kl, ".2e"),
            shown(r.p99_kl, ".2e"),
            shown(r.max_kl, ".2e"),
            shown(r.same_top1 * 100, ".1f") + "%",
            shown(r.delta_p_rms, ".2e"),
            shown(r.ln_ppl_ratio, "+.2e"),
            divergence,
            shown(mib_value(r.memory_bytes), ".2f"),
            r.note,
        )
    return table
