"""`larql accuracy --suite longctx | ppl-position`: the long-context suites."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.progress import Progress

from larql.cli.common import InvalidInput, stderr, stdout
from larql.cli.outputs import write_text, writing

if TYPE_CHECKING:  # the CLI answers --help without importing torch
    from larql.models.model import Model

SUITES = ("prompts", "longctx", "ruler", "ppl-position")


def _ints(option: str, text: str, low: int, high: int | None = None) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise InvalidInput(f"{option} takes comma-separated integers, got {text!r}") from None
    bad = [v for v in values if v < low or (high is not None and v > high)]
    if not values or bad:
        bound = f"in {low}..{high}" if high is not None else f"≥ {low}"
        raise InvalidInput(f"{option} takes integers {bound}, got {text!r}")
    return values


@dataclass(frozen=True)
class SuiteGrid:
    suite: str
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    depths: tuple[int, ...]
    seed: int

    @staticmethod
    def parse(
        suite: str,
        quick: bool,
        tasks: str | None,
        lengths: str | None,
        depths: str | None,
        seed: int,
    ) -> SuiteGrid:
        from larql.harness.longctx import tasks as catalog

        if tasks is None:
            chosen = catalog.QUICK_TASKS if quick else catalog.TASKS
        else:
            chosen = tuple(t.strip() for t in tasks.split(",") if t.strip())
            unknown = [t for t in chosen if t not in catalog.TASKS]
            if unknown or not chosen:
                raise InvalidInput(
                    f"--tasks: unknown {', '.join(unknown) or 'none given'}; "
                    f"known: {', '.join(catalog.TASKS)}"
                )
        default_lengths = catalog.QUICK_LENGTHS if quick else catalog.DEFAULT_LENGTHS
        default_depths = catalog.QUICK_DEPTHS if quick else catalog.DEFAULT_DEPTHS
        return SuiteGrid(
            suite=suite,
            tasks=chosen,
            lengths=_ints("--lengths", lengths, 16) if lengths else default_lengths,
            depths=_ints("--depth-percent", depths, 0, 100) if depths else default_depths,
            seed=seed,
        )

    def fitting(self, model: Model, margin: int) -> tuple[int, ...]:
        """The lengths that fit the model's context with `margin` tokens to spare."""
        fits = tuple(n for n in self.lengths if n + margin < model.config.max_positions)
        for n in sorted(set(self.lengths) - set(fits)):
            stderr.print(
                f"[yellow]skipping length {n}: the model's context is "
                f"{model.config.max_positions} tokens[/yellow]"
            )
        if not fits:
            raise InvalidInput(
                f"no --lengths fits the model's context of {model.config.max_positions} tokens"
            )
        return fits


def run_suite(
    model: Model,
    specs: list[str],
    ffn_specs: list[str],
    grid: SuiteGrid,
    text: Path | None,
    output_file: Path | None,
    plot: Path | None,
) -> None:
    from larql.inference.ffn import build_ffn
    from larql.kv.catalog import CATALOG

    if ffn_specs != ["dense"]:
        raise InvalidInput(f"--suite {grid.suite} runs the dense FFN; leave out --ffn")
    kinds = [CATALOG.parse(s) for s in specs]
    ffn = build_ffn(model, "dense")
    if grid.suite == "longctx":
        _longctx(model, ffn, kinds, grid, output_file, plot)
    else:
        _ppl_position(model, ffn, kinds, grid, text, output_file, plot)


def _longctx(model, ffn, kinds, grid: SuiteGrid, output_file, plot) -> None:
    from larql.harness.longctx.report import longctx_report, longctx_tables, save_longctx_plot
    from larql.harness.longctx.run import run_longctx
    from larql.harness.longctx.tasks import dataset_hash, generate_samples

    lengths = grid.fitting(model, margin=96)
    samples = generate_samples(model.tokenizer, grid.tasks, lengths, grid.depths, grid.seed)
    digest = dataset_hash(samples)
    stdout.print(f"longctx dataset: seed {grid.seed}, {len(samples)} samples, hash {digest}")
    cells = []
    with Progress(console=stderr, transient=True) as bar:
        task = bar.add_task("longctx", total=None)
        for kind in kinds:  # each engine's table (and the JSON so far) as soon as it is done
            mine = run_longctx(
                model, ffn, [kind], samples, progress=lambda s: bar.update(task, description=s)
            )
            cells += mine
            for table in longctx_tables(mine):
                stdout.print(table)
            if output_file is not None:
                report = longctx_report(cells, model.name, grid.seed, digest)
                write_text(output_file, json.dumps(report, indent=2), "--output-file")
    if plot is not None:
        with writing(plot, "--plot"):
            save_longctx_plot(cells, plot, f"{model.name}: long-context score (hash {digest})")


def _ppl_position(model, ffn, kinds, grid: SuiteGrid, text, output_file, plot) -> None:
    from larql.data import read_text
    from larql.harness.longctx.positions import (
        position_report,
        position_table,
        run_positions,
        save_position_plot,
    )

    body, label = read_text(text)
    length = max(grid.fitting(model, margin=1))
    with Progress(console=stderr, transient=True) as bar:
        task = bar.add_task("ppl-position", total=None)
        curves = run_positions(
            model, ffn, kinds, body, length, progress=lambda s: bar.update(task, description=s)
        )
    stdout.print(position_table(curves, label))
    if output_file is not None:
        report = position_report(curves, model.name, label)
        write_text(output_file, json.dumps(report, indent=2), "--output-file")
    if plot is not None:
        with writing(plot, "--plot"):
            save_position_plot(curves, plot, f"{model.name}: log-perplexity by position ({label})")
