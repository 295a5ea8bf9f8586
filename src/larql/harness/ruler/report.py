"""Rendering the ruler results: one table (task × length rows, a score and MiB column pair per
engine), the versioned JSON report (a per-engine summary first, then per task × length, then
every sample), and a plot of score against bytes held, one line per engine over the lengths."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from rich.table import Table

from larql.harness.formatting import Unbroken, shown
from larql.harness.ruler.run import SCHEMA, Cell, mean
from larql.inference.memory import mib_value


def engines_of(cells: list[Cell]) -> list[str]:
    return list(dict.fromkeys(c.engine for c in cells))


def _summary(cells: list[Cell]) -> dict[str, Any]:
    return {
        "score": mean([c.score for c in cells]),
        "memory_bytes": round(mean([float(c.memory_bytes) for c in cells if not c.error]) or 0)
        if any(not c.error for c in cells)
        else 0,
        "samples": len(cells),
        "errors": sum(1 for c in cells if c.error),
    }


def engine_rows(cells: list[Cell]) -> list[dict[str, Any]]:
    """Per engine: the mean score over every sample and the mean state bytes after the
    context."""
    return [
        {"engine": e, **_summary([c for c in cells if c.engine == e])} for e in engines_of(cells)
    ]


def task_rows(cells: list[Cell]) -> list[dict[str, Any]]:
    """Per engine × task × length."""
    groups: dict[tuple[str, str, int], list[Cell]] = defaultdict(list)
    for c in cells:
        groups[(c.engine, c.task, c.length)].append(c)
    return [
        {"engine": e, "task": t, "length": n, **_summary(group)}
        for (e, t, n), group in groups.items()
    ]


def _clean(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def ruler_report(cells: list[Cell], model: str, seed: int, dataset: str) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "suite": "ruler",
        "model": model,
        "seed": seed,
        "dataset_hash": dataset,
        "engines": [{k: _clean(v) for k, v in r.items()} for r in engine_rows(cells)],
        "tasks": [{k: _clean(v) for k, v in r.items()} for r in task_rows(cells)],
        "cells": [{k: _clean(v) for k, v in c.as_dict().items()} for c in cells],
    }


def ruler_table(cells: list[Cell]) -> Unbroken:
    """A row per engine and length, a column per task: the rows grow with the engines, so the
    table keeps its width however many are compared; a console too narrow for every task leaves
    out the last tasks' columns first (the JSON and a wider console have them), never the
    engine, its length, the mean or the state."""
    tasks = list(dict.fromkeys(c.task for c in cells))
    table = Table(
        title="RULER (compress-then-ask, greedy)",
        caption="score = share of the gold answers the greedy answer contains, mean over samples; "
        "MiB = the engine's state after the context, before the question (mean over samples)",
        caption_justify="left",
    )
    table.add_column("engine")
    table.add_column("length", justify="right")
    for task in tasks:
        table.add_column(task, justify="right")
    table.add_column("mean", justify="right")
    table.add_column("MiB", justify="right")
    by = {(r["engine"], r["task"], r["length"]): r for r in task_rows(cells)}
    lengths = sorted({c.length for c in cells})
    summary = {r["engine"]: r for r in engine_rows(cells)}
    for engine in engines_of(cells):
        for length in lengths:
            mine = [c for c in cells if c.engine == engine and c.length == length]
            if not mine:
                continue
            scores = [by.get((engine, task, length)) for task in tasks]
            whole = _summary(mine)
            table.add_row(
                engine,
                str(length),
                *[shown(r["score"], ".2f") if r else "" for r in scores],
                shown(whole["score"], ".2f"),
                shown(mib_value(whole["memory_bytes"]), ".1f"),
            )
        if len(lengths) > 1:
            r = summary[engine]
            row = [shown(r["score"], ".2f"), shown(mib_value(r["memory_bytes"]), ".1f")]
            table.add_row(engine, "all", *[""] * len(tasks), *row)
        table.rows[-1].end_section = True
    return Unbroken(table, tuple(reversed(tasks)))


def save_ruler_plot(cells: list[Cell], path: Path, title: str) -> None:
    """Each engine's mean score against its mean state MiB, one point per length joined by a
    line (longer contexts hold more bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5.5))
    for engine in engines_of(cells):
        mine = [c for c in cells if c.engine == engine and not c.error]
        lengths = sorted({c.length for c in mine})
        xs = [
            mib_value(mean([float(c.memory_bytes) for c in mine if c.length == n])) for n in lengths
        ]
        ys = [mean([c.score for c in mine if c.length == n]) for n in lengths]
        if xs:
            axes.plot(xs, ys, marker="o", label=engine)
            for x, y, n in zip(xs, ys, lengths, strict=True):
                axes.annotate(str(n), (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    axes.set(
        xlabel="state MiB after the context (mean)",
        ylabel="score (share of answers found)",
        ylim=(-0.05, 1.05),
        title=title,
    )
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
