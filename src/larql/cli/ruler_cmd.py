"""`larql accuracy --suite ruler`: RULER's task families, compress-then-ask."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from larql.cli.accuracy_longctx import _ints, gather
from larql.cli.common import InvalidInput, stderr, stdout
from larql.cli.outputs import write_text, writing
from larql.cli.progress import progress_lines

if TYPE_CHECKING:  # the CLI answers --help without importing torch
    from larql.models.model import Model


@dataclass(frozen=True)
class RulerGrid:
    tasks: tuple[str, ...] | None  # None: each length's default tasks
    lengths: tuple[int, ...]
    samples: int
    seed: int

    @staticmethod
    def parse(
        quick: bool,
        tasks: str | None,
        lengths: str | None,
        samples: int | None,
        seed: int,
    ) -> RulerGrid:
        from larql.harness.ruler import tasks as catalog

        chosen: tuple[str, ...] | None = None
        if tasks is not None:
            chosen = tuple(t.strip() for t in tasks.split(",") if t.strip())
            unknown = [t for t in chosen if t not in catalog.TASKS]
            if unknown or not chosen:
                raise InvalidInput(
                    f"--tasks: unknown {', '.join(unknown) or 'none given'}; "
                    f"known for --suite ruler: {', '.join(catalog.TASKS)}"
                )
        if samples is not None and samples < 1:
            raise InvalidInput(f"--samples must be ≥ 1, got {samples}")
        default_lengths = catalog.QUICK_LENGTHS if quick else catalog.DEFAULT_LENGTHS
        return RulerGrid(
            tasks=chosen,
            lengths=_ints("--lengths", lengths, catalog.MIN_LENGTH) if lengths else default_lengths,
            samples=samples or (catalog.QUICK_SAMPLES if quick else catalog.DEFAULT_SAMPLES),
            seed=seed,
        )

    def fitting(self, model: Model) -> tuple[int, ...]:
        """The lengths within the model's context (a length counts the question and answer)."""
        limit = model.config.max_positions
        fits = tuple(n for n in self.lengths if n <= limit)
        for n in sorted(set(self.lengths) - set(fits)):
            stderr.print(f"skipping length {n}: the model's context is {limit} tokens")
        if not fits:
            raise InvalidInput(f"no --lengths fits the model's context of {limit} tokens")
        return fits


def run_ruler_suite(
    model: Model,
    specs: list[str],
    grid: RulerGrid,
    output: str,
    output_file: Path | None,
    plot: Path | None,
    workers: int = 1,
    quiet: bool = False,
) -> None:
    from larql.harness.ruler.report import ruler_report, ruler_table, save_ruler_plot
    from larql.harness.ruler.run import score_job
    from larql.harness.ruler.tasks import dataset_hash, generate_samples

    lengths = grid.fitting(model)
    samples = generate_samples(model.tokenizer, grid.tasks, lengths, grid.samples, grid.seed)
    digest = dataset_hash(samples)
    tasks = len({s.task for s in samples})
    stderr.print(
        f"ruler dataset: seed {grid.seed}, {len(samples)} samples "
        f"({tasks} tasks × {len(lengths)} lengths × {grid.samples}), hash {digest}"
    )

    def engine_done(_, cells) -> None:  # the JSON so far, as each engine is in
        if output_file is not None:
            report = ruler_report(cells, model.name, grid.seed, digest)
            write_text(output_file, json.dumps(report, indent=2), "--output-file")

    with progress_lines("ruler", len(specs) * len(samples), quiet) as advance:
        cells = gather(
            model,
            score_job,
            specs,
            samples,
            workers,
            advance,
            lambda c: f"{c.engine}: {c.task} {c.length} #{c.index}",
            engine_done,
        )
    report = ruler_report(cells, model.name, grid.seed, digest)
    if plot is not None:
        with writing(plot, "--plot"):
            save_ruler_plot(cells, plot, f"{model.name}: RULER score vs bytes (hash {digest})")
    if output == "json":
        print(json.dumps(report, indent=2))
        return
    stdout.print(f"ruler dataset: seed {grid.seed}, {len(samples)} samples, hash {digest}")
    stdout.print(ruler_table(cells))
