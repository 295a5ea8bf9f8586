"""`--suite ppl-position`: per-position log-perplexity over a long text, binned by position,
one curve per engine — where a windowed or evicting engine starts to lose the context shows as
its curve leaving `standard`'s.

The text (the shipped one unless `--text`) is cycled to the longest length asked; the first
token is the prompt and every later one is teacher-forced through the engine's decode step."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from larql.harness.formatting import Unbroken, shown
from larql.inference.errors import EngineError
from larql.inference.ffn import FfnBackend, build_ffn
from larql.inference.generation import logits_of, teacher_forced_hidden
from larql.inference.memory import over_ranks
from larql.kv.catalog import parse_engine
from larql.kv.spec import EngineSpec
from larql.models.model import Model

SCHEMA = "larql.ppl-position/1"
BINS = 16


@dataclass(frozen=True)
class Curve:
    engine: str
    bin_edges: list[int]  # positions [edges[i], edges[i + 1]) form bin i
    mean_nll: list[float]  # nats per token in each bin
    memory_bytes: int
    error: str | None = None


def cycled_ids(model: Model, text: str, length: int) -> list[int]:
    """The text's tokens, repeated until `length` tokens (a separator between copies)."""
    ids = model.tokenizer.encode(text)
    if not ids:
        raise ValueError("the text has no tokens")
    tail = model.tokenizer.encode("\n\n" + text, add_special_tokens=False)
    while len(ids) < length:
        ids += tail
    return ids[:length]


def position_curve(model: Model, ffn: FfnBackend, spec: EngineSpec, ids: list[int]) -> Curve:
    """One engine's curve over `ids`: the first token the prompt, every later one fed as a
    decode step."""
    edges = [round(i * (len(ids) - 1) / BINS) + 1 for i in range(BINS + 1)]
    try:
        engine = spec.build(model)
        rows = logits_of(model, teacher_forced_hidden(engine, model, ffn, ids[:-1], 1))
        nll = [
            -float(torch.log_softmax(row.double(), dim=-1)[target])
            for row, target in zip(rows, ids[1:], strict=True)
        ]  # nll[i] predicts position i + 1
    except EngineError as e:
        return Curve(spec.spec(), edges, [], 0, f"{type(e).__name__}: {e}")
    means = [sum(nll[a - 1 : b - 1]) / max(1, b - a) for a, b in itertools.pairwise(edges)]
    return Curve(spec.spec(), edges, means, over_ranks(model, engine.memory().state)[0])


def position_job(model: Model, job: tuple[str, list[int]]) -> Curve:
    """One engine's curve from its spec's text and the ids: what one process runs for every
    engine in turn and a worker (`harness.workers`) for its share."""
    spec, ids = job
    return position_curve(model, build_ffn(model, "dense"), parse_engine(spec), ids)


def position_table(curves: list[Curve], label: str) -> Unbroken:
    table = Table(
        title=f"Log-perplexity (nats per token) by position — {label}",
        caption="each column one engine; rows are position bins",
        caption_justify="left",
    )
    table.add_column("positions")
    for c in curves:
        table.add_column(c.engine, justify="right")
    edges = curves[0].bin_edges
    for i, (a, b) in enumerate(itertools.pairwise(edges)):
        table.add_row(
            f"{a}–{b - 1}",
            *[
                c.error[:30]
                if c.error and i == 0
                else shown(c.mean_nll[i] if c.mean_nll else None, ".3f")
                for c in curves
            ],
        )
    return Unbroken(table, [c.engine for c in reversed(curves[1:])])


def position_report(curves: list[Curve], model: str, label: str) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "suite": "ppl-position",
        "model": model,
        "text": label,
        "curves": [
            {
                "engine": c.engine,
                "bin_edges": c.bin_edges,
                "mean_nll": [None if math.isnan(x) else x for x in c.mean_nll],
                "memory_bytes": c.memory_bytes,
                "error": c.error,
            }
            for c in curves
        ],
    }


def save_position_plot(curves: list[Curve], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for c in curves:
        if c.mean_nll:
            centers = [(a + b) / 2 for a, b in zip(c.bin_edges, c.bin_edges[1:], strict=False)]
            axes.plot(centers, c.mean_nll, marker=".", label=c.engine)
    axes.set(xlabel="position", ylabel="mean NLL (nats per token)", title=title)
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
