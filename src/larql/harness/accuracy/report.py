"""Rendering an accuracy report: the split table, served-rate lines, and the fidelity table."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from larql.harness.accuracy.fidelity import Fidelity
from larql.harness.formatting import Unbroken, shown
from larql.inference.memory import mib_value

# At a narrow terminal the columns go in this order, the least telling first.
FIDELITY_DROP = (
    "cos",
    "MRR",
    "JS",
    "top-5",
    "Δp RMS",
    "median",
    "p99",
    "max",
    "× fp16",
    "greedy divergence",
    "ln PPL ratio",
    "match",
    "positions",
    "state MiB",
    "same top-1",
)


def fidelity_table(rows: list[Fidelity], text_label: str) -> Unbroken:
    table = Table(
        title=f"Teacher-forced fidelity vs standard (full cache) — {text_label}",
        caption="KL(standard‖engine) in nats per position; Δp = change in p(true next token); "
        "ln PPL ratio = ln(PPL(engine)/PPL(standard)); divergence = first greedy step that "
        "differs; JS = Jensen–Shannon (nats), top-5 = overlap of the top-5 sets, MRR = mean "
        "reciprocal rank of standard's top-1, cos = cosine of the hidden rows, match = greedy "
        "tokens equal",
        caption_justify="left",
    )
    for col in (
        "strategy",
        "positions",
        "mean KL",
        "median",
        "p99",
        "max",
        "same top-1",
        "Δp RMS",
        "ln PPL ratio",
        "greedy divergence",
        "JS",
        "top-5",
        "MRR",
        "cos",
        "match",
        "state MiB",
        "× fp16",
        "note",
    ):
        table.add_column(col, justify="left" if col in ("strategy", "note") else "right")
    for r in rows:
        if r.error:
            table.add_row(r.spec, *[""] * 16, f"error: {r.error}")
            continue
        divergence = (
            "—"
            if not r.greedy_steps
            else f"none in {r.greedy_steps}"
            if r.first_divergence is None
            else f"step {r.first_divergence}"
        )
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
            shown(r.mean_js, ".2e"),
            shown(r.top5_overlap, ".3f"),
            shown(r.mrr, ".3f"),
            shown(r.hidden_cosine, ".5f"),
            "—" if r.token_match is None else f"{r.token_match:.0%}",
            shown(mib_value(r.memory_bytes), ".2f"),
            shown(r.ratio_vs_fp16, ".3f"),
            r.note,
        )
    return Unbroken(table, FIDELITY_DROP)


def save_frontier_plot(rows: list[Fidelity], path: Path, title: str) -> None:
    """KL against bytes: each engine's mean teacher-forced KL (log scale) over its state's
    bytes per token as a fraction of an fp16 full cache's, one labelled point per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [r for r in rows if not r.error and r.ratio_vs_fp16 and r.mean_kl > 0]
    figure, axes = plt.subplots(figsize=(8, 5.5))
    for r in points:
        axes.scatter(r.ratio_vs_fp16, r.mean_kl)
        axes.annotate(
            r.spec,
            (r.ratio_vs_fp16, r.mean_kl),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    axes.set(
        xlabel="state bytes / fp16 full cache (same tokens)",
        ylabel="mean KL (nats)",
        yscale="log",
        title=title,
    )
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
