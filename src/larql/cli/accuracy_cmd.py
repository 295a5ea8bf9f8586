"""`larql accuracy`: what each engine changes — three prompt corpora and teacher-forced fidelity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from larql.cli.accuracy_longctx import SUITES, SuiteGrid
from larql.cli.common import InvalidInput, open_model, stdout, user_errors
from larql.cli.ffn_options import MoeShardsOption, moe_shards_spec
from larql.cli.options import DeviceOption, DtypeOption, ModelOption, ThreadsOption, WeightsOption
from larql.cli.outputs import check_output_file, check_plot_file, write_text, writing
from larql.cli.progress import progress_lines
from larql.cli.renamed import output_format, renamed
from larql.cli.tensor_parallel import TensorParallelOption, check_model, launch, threads_per_rank
from larql.cli.tensor_parallel import wanted as tensor_parallel_wanted


def default_engines(suite: str = "prompts") -> str:
    from larql.harness.accuracy.run import default_specs
    from larql.kv.catalog import CATALOG

    if suite == "prompts":
        return ";".join(default_specs())
    # the long-context suites: the engines that keep less than the full cache, and the
    # reference (the exact ones score like `standard` there, at a far higher cost per cell)
    return ";".join(CATALOG.default_specs("longctx"))


@user_errors
def accuracy(
    model: ModelOption = None,
    engines: Annotated[
        str | None,
        typer.Option(
            "--engine",
            help="Engine specs (; or , separated); the default depends on --suite.",
        ),
    ] = None,
    old_engines: Annotated[
        str | None, typer.Option("--engines", hidden=True, help="Old spelling of --engine.")
    ] = None,
    ffn: Annotated[
        str,
        typer.Option(
            "--ffn-policy",
            help="FFN policies, comma separated (braces keep their commas), e.g. "
            "'dense,walk:k=100'; more than one (or not dense) labels strategies kv@ffn.",
        ),
    ] = "dense",
    old_ffn: Annotated[
        str | None, typer.Option("--ffn", hidden=True, help="Old spelling of --ffn-policy.")
    ] = None,
    moe_shards: MoeShardsOption = None,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help="5 parametric, 2 needles, 5 conflicts; 128 positions (64 for O(N²) engines) "
            "after a 256-token prompt, 32 greedy steps; --suite longctx / ruler: fewer tasks, "
            "lengths and samples.",
        ),
    ] = False,
    parametric_n: Annotated[
        int | None,
        typer.Option(
            "--parametric-n", help="The first N of the 100 parametric prompts (default: all)."
        ),
    ] = None,
    needle_max_tokens: Annotated[int, typer.Option("--needle-max-tokens")] = 8192,
    no_conflict: Annotated[bool, typer.Option("--no-conflict")] = False,
    no_fidelity: Annotated[bool, typer.Option("--no-fidelity")] = False,
    text: Annotated[
        Path | None, typer.Option("--text", help="Fidelity text (default: the shipped one).")
    ] = None,
    positions: Annotated[
        int | None, typer.Option("--positions", help="Teacher-forced positions (default: all).")
    ] = None,
    prompt_tokens: Annotated[
        int | None,
        typer.Option(
            "--prompt-tokens",
            help="Fidelity: the text's first N tokens are the prompt (prefilled), the rest "
            "teacher-forced; a long prompt shows what an engine compresses after its prefill "
            "(default 16; --quick 256, past the quantisers' exact recent rows).",
        ),
    ] = None,
    output_file: Annotated[Path | None, typer.Option("--output-file", help="JSON report.")] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="PNG of each engine's mean KL against its bytes.")
    ] = None,
    suite: Annotated[
        str,
        typer.Option(
            "--suite",
            help="prompts (corpora + teacher-forced fidelity), longctx (long-context tasks, "
            "compress-then-ask), ruler (RULER's task families, compress-then-ask) or "
            "ppl-position (log-perplexity by position over a long text).",
        ),
    ] = "prompts",
    tasks: Annotated[
        str | None,
        typer.Option("--tasks", help="longctx / ruler tasks, comma separated (default: all)."),
    ] = None,
    lengths: Annotated[
        str | None,
        typer.Option(
            "--lengths",
            help="longctx / ruler / ppl-position context lengths in tokens, "
            "comma separated (default 512,1024,2048,4096,8192 within the model's "
            "context; --quick 512,1024,2048; ruler: 1024 up to 16384, --quick 1024).",
        ),
    ] = None,
    depths: Annotated[
        str | None,
        typer.Option(
            "--depth-percent",
            help="longctx needle depths, in percent of the context (default 0,25,50,75,100; "
            "--quick 0,50,100).",
        ),
    ] = None,
    old_depths: Annotated[
        str | None, typer.Option("--depths", hidden=True, help="Old spelling of --depth-percent.")
    ] = None,
    samples: Annotated[
        int | None,
        typer.Option("--samples", help="ruler samples per task and length (default 4; --quick 1)."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="longctx / ruler dataset seed.")] = 0,
    output: Annotated[
        str,
        typer.Option("--output", "-o", help="text or json (--suite prompts or ruler)."),
    ] = "text",
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            help="Spread the work over N processes, each loading the model and running "
            "--threads threads (give cores/N): the engines (--suite prompts), engine × sample "
            "cells (longctx, ruler) or engines (ppl-position); the same table and JSON as one "
            "process with those threads. --device cuda: worker i on cuda:(i mod GPUs).",
        ),
    ] = 1,
    dtype: DtypeOption = "float32",
    weights: WeightsOption = "auto",
    device: DeviceOption = "cpu",
    threads: ThreadsOption = None,
    tensor_parallel: TensorParallelOption = 1,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
    quiet: Annotated[
        bool,
        typer.Option(
            "-q",
            "--quiet",
            help="No progress on stderr (else a bar, or a line per item "
            "where stderr is not a terminal).",
        ),
    ] = False,
) -> None:
    """What each engine changes: prompt corpora scores and teacher-forced fidelity.

    Every engine is scored on parametric facts, needles and conflicts, and its next-token
    distributions are compared with the full cache's over a text."""
    engines = renamed(engines, old_engines, "--engine", "--engines", None)
    ffn = renamed(ffn, old_ffn, "--ffn-policy", "--ffn", "dense")
    depths = renamed(depths, old_depths, "--depth-percent", "--depths", None)
    # a rank runs this command again with these options (the old spellings already read)
    options = {
        name: value
        for name, value in locals().items()
        if name not in ("tensor_parallel", "old_engines", "old_ffn", "old_depths")
    }
    from larql.api import accuracy as run_accuracy
    from larql.harness.accuracy.aggregate import served_lines, split_table
    from larql.harness.accuracy.report import fidelity_table
    from larql.inference.ffn.policy import FfnLayerPolicy, split_specs
    from larql.kv.catalog import CATALOG

    specs = CATALOG.split_specs(engines or default_engines(suite))
    kinds = [CATALOG.parse(s) for s in specs]
    if not kinds:
        raise InvalidInput(f"--engine lists no engine; {CATALOG.supported_message()}")
    ffn_specs = split_specs(ffn) or ["dense"]
    if moe_shards is not None:
        if ffn != "dense":
            raise InvalidInput("give --ffn-policy or --moe-shards, not both")
        ffn_specs = [moe_shards_spec(moe_shards)]
    for spec in ffn_specs:
        FfnLayerPolicy.from_spec(spec)  # a typo fails before the model loads
    if positions is not None and positions < 1:
        raise InvalidInput(f"--positions must be ≥ 1, got {positions}")
    if prompt_tokens is not None and prompt_tokens < 1:
        raise InvalidInput(f"--prompt-tokens must be ≥ 1, got {prompt_tokens}")
    if suite not in SUITES:
        raise InvalidInput(f"--suite must be one of {', '.join(SUITES)}, got {suite!r}")
    output = output_format(output, ("text", "json"))
    if output == "json" and suite not in ("prompts", "ruler"):
        raise InvalidInput(
            f"--output json prints --suite prompts or ruler; for --suite {suite} give --output-file"
        )
    if workers < 1:
        raise InvalidInput(f"--workers must be ≥ 1, got {workers}")
    if suite != "ruler" and samples is not None:
        raise InvalidInput("--samples is for --suite ruler")
    if plot is not None and suite == "prompts" and no_fidelity:
        raise InvalidInput("--plot draws the fidelity results: leave out --no-fidelity")
    check_output_file(output_file, "--output-file")
    check_plot_file(plot)
    if tensor_parallel_wanted(tensor_parallel):
        if workers > 1:
            raise InvalidInput("give --workers or --tensor-parallel, not both")
        if ffn_specs != ["dense"]:
            from larql.models.shard import TensorParallelError

            raise TensorParallelError(
                "--tensor-parallel runs the model's own dense MLP, split; it does not take "
                "--ffn-policy or --moe-shards"
            )
        check_model(model, tensor_parallel)
        options["threads"] = threads_per_rank(threads, tensor_parallel)
        launch(tensor_parallel, _rank_accuracy, options, device)
        return
    if suite == "ruler":
        from larql.cli.ruler_cmd import RulerGrid, run_ruler_suite

        if ffn_specs != ["dense"]:
            raise InvalidInput("--suite ruler runs the dense FFN; leave out --ffn-policy")
        if depths is not None:
            raise InvalidInput(
                "--suite ruler places its facts at random depths; drop --depth-percent"
            )
        ruler_grid = RulerGrid.parse(quick, tasks, lengths, samples, seed)
        lm = open_model(model, dtype, device, threads, weights)
        run_ruler_suite(lm, specs, ruler_grid, output, output_file, plot, workers, quiet)
        return
    if suite != "prompts":
        from larql.cli.accuracy_longctx import run_suite

        grid = SuiteGrid.parse(suite, quick, tasks, lengths, depths, seed)
        lm = open_model(model, dtype, device, threads, weights)
        run_suite(lm, specs, ffn_specs, grid, text, output_file, plot, workers, quiet)
        return
    lm = open_model(model, dtype, device, threads, weights)
    # the corpora, one item per strategy; the fidelity reference, then one per strategy
    strategies = len(kinds) * len(ffn_specs)
    total = strategies + (0 if no_fidelity else strategies + 1)
    if workers > 1:  # a line as each worker's share comes back
        total = min(workers, len(kinds))
    with progress_lines("accuracy", total, quiet) as advance:
        report = run_accuracy(
            lm,
            kinds,
            ffn_policy=ffn_specs,
            quick=quick,
            parametric_n=parametric_n,
            needle_max_tokens=needle_max_tokens,
            conflict=not no_conflict,
            fidelity=not no_fidelity,
            text_file=text,
            positions=positions,
            prompt_tokens=prompt_tokens,
            progress=advance,
            workers=workers,
        )
    if output_file is not None:
        write_text(output_file, json.dumps(report.as_dict(), indent=2), "--output-file")
    if plot is not None:
        from larql.harness.accuracy.report import save_frontier_plot

        label = report.meta["fidelity_text"]
        with writing(plot, "--plot"):
            save_frontier_plot(report.fidelity, plot, f"{lm.name}: KL vs bytes ({label})")
    if output == "json":
        print(json.dumps(report.as_dict(), indent=2))
        return
    stdout.print(split_table(report.splits))
    for line in served_lines(report.splits):
        stdout.print(line)
    if verbose:
        for s in report.scores:
            verdict = (
                s.outcome.value
                if not s.served
                else (
                    (
                        "FOLLOW"
                        if s.followed_context
                        else "FALLBACK"
                        if s.parametric_fallback
                        else "OTHER"
                    )
                    if s.source == "conflict"
                    else ("HIT" if s.matched else "MISS")
                )
            )
            stdout.print(
                f"  [{s.strategy}] {s.category:<12} {verdict:<9} "
                f"predicted={s.predicted!r} expected={s.expected!r}"
            )
    if report.fidelity:
        stdout.print(fidelity_table(report.fidelity, report.meta["fidelity_text"]))


def _rank_accuracy(shard: object, options: dict) -> None:
    """One rank of `larql accuracy --tensor-parallel`: the same suite on its share of the model
    (`open_model` loads it); rank 0 alone reports and writes files."""
    if getattr(shard, "rank", 0) != 0:
        options = {**options, "output_file": None, "plot": None, "quiet": True, "verbose": False}
    accuracy(**options)
