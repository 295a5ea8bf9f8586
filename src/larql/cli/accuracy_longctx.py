"""`larql accuracy --suite longctx | ppl-position`: the long-context suites."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from larql.cli.common import InvalidInput, stderr, stdout
from larql.cli.outputs import write_text, writing
from larql.cli.progress import Advance, progress_lines

if TYPE_CHECKING:  # the CLI answers --help without importing torch
    from larql.models.model import Model

Cell = TypeVar("Cell")  # what one engine on one unit of a suite gives

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
                f"skipping length {n}: the model's context is {model.config.max_positions} tokens"
            )
        if not fits:
            raise InvalidInput(
                f"no --lengths fits the model's context of {model.config.max_positions} tokens"
            )
        return fits


def gather(
    model: Model,
    work: Callable[[Model, tuple[str, Any]], Cell],
    specs: list[str],
    units: list[Any],
    workers: int,
    progress: Advance,
    label: Callable[[Cell], str],
    engine_done: Callable[[list[Cell], list[Cell]], None] | None = None,
) -> list[Cell]:
    """`work(model, (spec, unit))` for every engine × unit, engine by engine, on `workers`
    processes (`harness.workers.spread`: one runs here), → the cells in that order.
    `progress(label(cell))` as each cell comes in; `engine_done(its cells, every cell so far)`
    as each engine's last cell comes in after every earlier engine's, so that an engine's table
    and the JSON so far come out in one process's order."""
    from larql.harness.workers import spread

    jobs = [(spec, unit) for spec in specs for unit in units]
    cells: dict[int, Cell] = {}
    per = len(units)
    ready = 0  # engines handed to engine_done

    def done(i: int, cell: Cell) -> None:
        nonlocal ready
        cells[i] = cell
        progress(label(cell))
        while ready < len(specs) and all(j in cells for j in range(ready * per, (ready + 1) * per)):
            ready += 1
            if engine_done is not None:
                so_far = [cells[j] for j in range(ready * per)]
                engine_done(so_far[-per:], so_far)

    return spread(model, work, jobs, workers, done)


def run_suite(
    model: Model,
    specs: list[str],
    ffn_specs: list[str],
    grid: SuiteGrid,
    text: Path | None,
    output_file: Path | None,
    plot: Path | None,
    workers: int = 1,
    quiet: bool = False,
) -> None:
    if ffn_specs != ["dense"]:
        raise InvalidInput(f"--suite {grid.suite} runs the dense FFN; leave out --ffn")
    if grid.suite == "longctx":
        _longctx(model, specs, grid, output_file, plot, workers, quiet)
    else:
        _ppl_position(model, specs, grid, text, output_file, plot, workers, quiet)


def _longctx(model, specs, grid: SuiteGrid, output_file, plot, workers, quiet) -> None:
    from larql.harness.longctx.report import longctx_report, longctx_tables, save_longctx_plot
    from larql.harness.longctx.run import score_job
    from larql.harness.longctx.tasks import dataset_hash, generate_samples

    lengths = grid.fitting(model, margin=96)
    samples = generate_samples(model.tokenizer, grid.tasks, lengths, grid.depths, grid.seed)
    digest = dataset_hash(samples)
    stdout.print(f"longctx dataset: seed {grid.seed}, {len(samples)} samples, hash {digest}")

    def engine_done(mine, cells) -> None:  # its table (and the JSON so far) as soon as it is in
        for table in longctx_tables(mine):
            stdout.print(table)
        if output_file is not None:
            report = longctx_report(cells, model.name, grid.seed, digest)
            write_text(output_file, json.dumps(report, indent=2), "--output-file")

    with progress_lines("longctx", len(specs) * len(samples), quiet) as advance:
        cells = gather(
            model,
            score_job,
            specs,
            samples,
            workers,
            advance,
            lambda c: f"{c.engine}: {c.task} {c.length} @{c.depth_percent}%",
            engine_done,
        )
    if plot is not None:
        with writing(plot, "--plot"):
            save_longctx_plot(cells, plot, f"{model.name}: long-context score (hash {digest})")


def _ppl_position(model, specs, grid: SuiteGrid, text, output_file, plot, workers, quiet) -> None:
    from larql.data import read_text
    from larql.harness.longctx.positions import (
        cycled_ids,
        position_job,
        position_report,
        position_table,
        save_position_plot,
    )

    body, label = read_text(text)
    ids = cycled_ids(model, body, max(grid.fitting(model, margin=1)))
    with progress_lines("ppl-position", len(specs), quiet) as advance:
        curves = gather(
            model,
            position_job,
            specs,
            [ids],
            workers,
            advance,
            lambda c: f"{c.engine}: {len(ids)} positions",
        )
    stdout.print(position_table(curves, label))
    if output_file is not None:
        report = position_report(curves, model.name, label)
        write_text(output_file, json.dumps(report, indent=2), "--output-file")
    if plot is not None:
        with writing(plot, "--plot"):
            save_position_plot(curves, plot, f"{model.name}: log-perplexity by position ({label})")
