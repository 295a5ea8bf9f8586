"""Rendering the long-context results: a table per engine (rows task × length, the mean over
depths), the versioned JSON report, and a plot (a length × depth heat map per engine, and the
mean score against the bytes held)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from rich.table import Table

from larql.harness.formatting import Unbroken, shown
from larql.harness.longctx.run import SCHEMA, Cell
from larql.inference.memory import mib_value


def _mean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def engines_of(cells: list[Cell]) -> list[str]:
    return list(dict.fromkeys(c.engine for c in cells))


def longctx_tables(cells: list[Cell]) -> list[Unbroken]:
    tables = []
    for engine in engines_of(cells):
        mine = [c for c in cells if c.engine == engine]
        groups: dict[tuple[str, int], list[Cell]] = defaultdict(list)
        for c in mine:
            groups[(c.task, c.length)].append(c)
        table = Table(
            title=f"{engine}: long-context score (compress-then-ask)",
            caption="score = share of depths where greedy decoding writes the answer; "
            "ln p = the gold answer's log-probability, mean over depths; MiB = state after "
            "the answer (largest over depths)",
            caption_justify="left",
        )
        for col in ("task", "length", "depths", "score", "ln p(answer)", "state MiB", "errors"):
            table.add_column(col, justify="left" if col == "task" else "right")
        for (task, length), group in groups.items():
            errors = [c for c in group if c.error]
            table.add_row(
                task,
                str(length),
                str(len(group)),
                shown(_mean([c.score for c in group]), ".2f"),
                shown(_mean([c.answer_logprob for c in group]), ".2f"),
                shown(mib_value(max(c.memory_bytes for c in group)), ".2f"),
                errors[0].error if errors else "",
            )
        table.add_row(
            "all",
            "",
            str(len(mine)),
            shown(_mean([c.score for c in mine]), ".2f"),
            shown(_mean([c.answer_logprob for c in mine]), ".2f"),
            "",
            "",
        )
        tables.append(Unbroken(table, ("depths", "ln p(answer)")))
    return tables


def longctx_report(cells: list[Cell], model: str, seed: int, dataset: str) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "suite": "longctx",
        "model": model,
        "seed": seed,
        "dataset_hash": dataset,
        "cells": [
            {
                k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in c.as_dict().items()
            }
            for c in cells
        ],
    }


def save_longctx_plot(cells: list[Cell], path: Path, title: str) -> None:
    """One heat map per engine (length × depth, the mean score over tasks), then each engine's
    mean score against the largest state it held."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = engines_of(cells)
    lengths = sorted({c.length for c in cells})
    depths = sorted({c.depth_percent for c in cells})
    columns = min(4, len(engines) + 1)
    rows = -(-(len(engines) + 1) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3.4 * columns, 3.0 * rows), squeeze=False)
    panels = [ax for row in axes for ax in row]
    for ax in panels[len(engines) + 1 :]:
        ax.axis("off")
    for ax, engine in zip(panels, engines, strict=False):
        grid = [
            [
                _mean(
                    [
                        c.score
                        for c in cells
                        if c.engine == engine and c.length == length and c.depth_percent == depth
                    ]
                )
                for depth in depths
            ]
            for length in lengths
        ]
        ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", origin="lower")
        ax.set(
            title=engine,
            xlabel="needle depth %",
            ylabel="context tokens",
            xticks=range(len(depths)),
            xticklabels=depths,
            yticks=range(len(lengths)),
            yticklabels=lengths,
        )
        ax.title.set_fontsize(8)
    last = panels[len(engines)]
    for engine in engines:
        mine = [c for c in cells if c.engine == engine]
        mib = mib_value(max(c.memory_bytes for c in mine))
        last.scatter(mib, _mean([c.score for c in mine]))
        last.annotate(engine, (mib, _mean([c.score for c in mine])), fontsize=6)
    last.set(xlabel="state MiB (largest)", ylabel="mean score", ylim=(-0.05, 1.05))
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
