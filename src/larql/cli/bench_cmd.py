"""`larql bench`: speed, memory and roofline of every engine, optionally against HF transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from larql.cli.common import InvalidInput, open_model, stderr, stdout, user_errors
from larql.cli.engine_names import engines_help
from larql.cli.ffn_options import (
    FfnPolicyOption,
    FfnUrlOption,
    MoeShardsOption,
    check_policy,
    ffn_policy_spec,
)
from larql.cli.options import DeviceOption, DtypeOption, ModelOption, ThreadsOption, WeightsOption
from larql.cli.outputs import check_output_file, check_plot_file, write_text, writing
from larql.cli.progress import progress_lines
from larql.cli.renamed import output_format, renamed
from larql.cli.tensor_parallel import TensorParallelOption, check_model, launch, threads_per_rank
from larql.cli.tensor_parallel import wanted as tensor_parallel_wanted

if TYPE_CHECKING:  # torch loads in the command's body, not for `--help`
    from larql.harness.bench.engine_bench import EngineRow
    from larql.models.model import Model


def parse_int_list(value: str | None, option: str, minimum: int) -> list[int]:
    """`--depths` / `--batch`: comma-separated integers, each ≥ `minimum` (none: [])."""
    if not value:
        return []
    try:
        numbers = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise InvalidInput(f"{option} must be comma-separated integers, got {value!r}") from None
    if any(n < minimum for n in numbers):
        raise InvalidInput(f"{option} must be ≥ {minimum}")
    return numbers


@user_errors
def bench(
    model: ModelOption = None,
    engine: Annotated[
        str | None,
        typer.Option(
            "--engine",
            help='Specs, e.g. "standard;markov-rs:window=64" (default: every engine as its '
            f"catalog entry says a bench runs it). {engines_help()}",
        ),
    ] = None,
    prompt_tokens: Annotated[
        int | None,
        typer.Option("--prompt-tokens", help="Prompt of N tokens cut from --text (default 128)."),
    ] = None,
    old_context: Annotated[
        int | None, typer.Option("--context", hidden=True, help="Old spelling of --prompt-tokens.")
    ] = None,
    prompt: Annotated[str | None, typer.Option("--prompt", help="Prompt text instead.")] = None,
    text: Annotated[
        Path | None, typer.Option("--text", help="Text to cut contexts from (default: shipped).")
    ] = None,
    tokens: Annotated[
        int, typer.Option("-n", "--max-tokens", help="New tokens: the timed decode steps.")
    ] = 32,
    old_tokens: Annotated[
        int | None, typer.Option("--tokens", hidden=True, help="Old spelling of --max-tokens.")
    ] = None,
    old_engines: Annotated[
        str | None, typer.Option("--engines", hidden=True, help="Spelling of --engine.")
    ] = None,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed steps first.")] = 3,
    repeats: Annotated[int, typer.Option("--repeats", help="Fresh runs per engine.")] = 3,
    depths: Annotated[
        str | None,
        typer.Option(
            "--depths",
            help="Several contexts, e.g. 0,512,2048: tokens in the engine before the timed steps "
            "(0 = a one-token prompt).",
        ),
    ] = None,
    batch: Annotated[
        str | None,
        typer.Option(
            "--batch",
            help="Also time B sessions decoding at once, e.g. 1,4,16: aggregate tok/s, "
            "per-stream ms/token, memory per session.",
        ),
    ] = None,
    concurrent: Annotated[
        int | None,
        typer.Option(
            "--concurrent",
            help="Also time N sessions of each engine decoding at once on N threads, each "
            "stepping alone (contention, not batching).",
        ),
    ] = None,
    shared_prefix: Annotated[
        int | None,
        typer.Option(
            "--shared-prefix",
            help="Also time a second question about a document of N tokens, started from the "
            "prefix cache, against the first question's time to first token.",
        ),
    ] = None,
    profile: Annotated[bool, typer.Option("--profile", help="Per-stage breakdown.")] = False,
    vs_hf: Annotated[bool, typer.Option("--vs-hf", help="Add HF transformers generate.")] = False,
    output: Annotated[str, typer.Option("--output", "-o", help="text or json.")] = "text",
    output_file: Annotated[Path | None, typer.Option("--output-file", help="Write JSON.")] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="PNG of tok/s, memory vs depth.")
    ] = None,
    ffn_policy: FfnPolicyOption = None,
    ffn: FfnUrlOption = None,
    moe_shards: MoeShardsOption = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    weights: WeightsOption = "auto",
    threads: ThreadsOption = None,
    tensor_parallel: TensorParallelOption = 1,
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            help="Spread the engines over N processes, each loading the model and timing its "
            "share (interleaved as one process does): on the CPU each pinned to 1/N of the cores "
            "with 1/N of --threads; --device cuda: worker i on cuda:(i mod GPUs). Workers that "
            "share a CPU or a GPU slow each other (a warning says so).",
            metavar="N",
        ),
    ] = 1,
    verbose: Annotated[
        bool,
        typer.Option(
            "-v",
            "--verbose",
            help="Each row's decode path (device · dtype · weights · kernels) and note on stderr.",
        ),
    ] = False,
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
    """Time every engine (whole tokens), report memory and roofline, optionally vs HF."""
    options = {
        name: value
        for name, value in locals().items()
        if name not in ("tensor_parallel", "workers")
    }
    tokens = renamed(tokens, old_tokens, "-n/--max-tokens", "--tokens", 32)
    engine = renamed(engine, old_engines, "--engine", "--engines", None)
    prompt_tokens = renamed(prompt_tokens, old_context, "--prompt-tokens", "--context", None)
    output = output_format(output, ("text", "json"))
    given = [
        name
        for name, value in (
            ("--prompt-tokens", prompt_tokens),
            ("--prompt", prompt),
            ("--depths", depths),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise InvalidInput(
            f"give one of --prompt-tokens, --depths, --prompt (got {' and '.join(given)})"
        )
    checked = [("-n/--max-tokens", tokens, 1), ("--repeats", repeats, 1), ("--warmup", warmup, 0)]
    if prompt_tokens is not None:
        checked.append(("--prompt-tokens", prompt_tokens, 1))
    if concurrent is not None:
        checked.append(("--concurrent", concurrent, 1))
    checked.append(("--workers", workers, 1))
    if shared_prefix is not None:
        checked.append(("--shared-prefix", shared_prefix, 1))
    for name, value, low in checked:
        if value < low:
            raise InvalidInput(f"{name} must be ≥ {low}, got {value}")
    # the checks above need no torch: a typo is answered at once
    from larql.api import bench as run_bench
    from larql.api import parse_engines
    from larql.harness.bench.report import (
        batch_table,
        concurrent_table,
        prefix_table,
        render_table,
        save_plot,
        stage_tables,
    )
    from larql.harness.bench.run import default_specs

    kinds = parse_engines(engine or default_specs())
    depth_list = parse_int_list(depths, "--depths", 0)
    batch_sizes = parse_int_list(batch, "--batch", 1)
    ffn_spec = ffn_policy_spec(ffn_policy, ffn, moe_shards=moe_shards)
    check_policy(ffn_spec)
    check_output_file(output_file, "--output-file")
    check_plot_file(plot)
    if tensor_parallel_wanted(tensor_parallel):
        if workers > 1:
            raise InvalidInput("give --workers or --tensor-parallel, not both")
        _check_tensor_parallel(options, tensor_parallel)
        options["threads"] = threads_per_rank(threads, tensor_parallel)
        launch(tensor_parallel, _rank_bench, options, device)
        return
    lm = open_model(model, dtype, device, threads, weights)
    # one item per depth for the engines (interleaved), and one each for --batch,
    # --concurrent and --vs-hf; one for --shared-prefix
    contexts = 1 if prompt is not None else len(depth_list) or 1
    total = contexts * (1 + bool(batch_sizes) + bool(concurrent) + vs_hf)
    total += shared_prefix is not None
    if workers > 1 and len(kinds) > 1:  # a line as each worker's share comes back
        total = min(workers, len(kinds))
        _warn_shared(lm, total)
    with progress_lines("bench", total, quiet) as advance:
        report = run_bench(
            lm,
            kinds,
            prompt_tokens=prompt_tokens,
            depths=depth_list or None,
            prompt=prompt,
            text_file=text,
            max_new_tokens=tokens,
            warmup=warmup,
            repeats=repeats,
            profile=profile,
            vs_hf=vs_hf,
            ffn_policy=ffn_spec,
            progress=advance,
            batch=batch_sizes or None,
            concurrent=concurrent,
            shared_prefix=shared_prefix,
            workers=workers,
        )
    data = report.as_dict()
    if output_file is not None:
        write_text(output_file, json.dumps(data, indent=2), "--output-file")
    if plot is not None:
        with writing(plot, "--plot"):
            save_plot(report, plot)
    if output == "json":
        print(json.dumps(data, indent=2))
    else:
        stdout.print(render_table(report))
        if report.batch_rows:
            stdout.print(batch_table(report))
        if report.concurrent_rows:
            stdout.print(concurrent_table(report))
        if report.prefix_rows:
            stdout.print(prefix_table(report))
        for table in stage_tables(report):
            stdout.print(table)
    if verbose:
        verbose_rows(report.rows)


def _warn_shared(model: Model, workers: int) -> None:
    """Workers on one CPU (or GPU) time each other's load: say so, once, before they start."""
    import torch

    from larql.harness.workers import shares_hardware

    device = model.load_args.device if model.load_args else str(model.device)
    gpus = torch.cuda.device_count() if model.device.type == "cuda" else 0
    if shares_hardware(device, workers, gpus):
        where = "GPU" if model.device.type == "cuda" else "machine's memory and caches"
        stderr.print(
            f"warning: {workers} bench workers share this {where}: each row is timed "
            "while other workers run, so rows are not comparable with one process's (nor, "
            "strictly, with each other's); one GPU per worker (--device cuda) avoids it"
        )


def _check_tensor_parallel(options: dict, size: int) -> None:
    """What a tensor-parallel bench refuses, before any process starts."""
    from larql.models.shard import TensorParallelError

    for flag, key in (
        ("--vs-hf", "vs_hf"),
        ("--concurrent", "concurrent"),
        ("--ffn-policy", "ffn_policy"),
        ("--ffn", "ffn"),
        ("--moe-shards", "moe_shards"),
    ):
        if options[key]:
            raise TensorParallelError(f"--tensor-parallel does not take {flag} on larql bench")
    check_model(options["model"], size)


def _rank_bench(shard: object, options: dict) -> None:
    """One rank of `larql bench --tensor-parallel`: the same bench on its share of the model
    (`open_model` loads it); rank 0 alone reports."""
    if getattr(shard, "rank", 0) != 0:
        options = {**options, "output_file": None, "plot": None, "quiet": True, "verbose": False}
    bench(**options)


def verbose_rows(rows: list[EngineRow]) -> None:
    """`-v`: what each row ran and its note, one line each on stderr (JSON has them too)."""
    for row in rows:
        ran = row.error if row.decode_path is None else f"decode path: {row.decode_path}"
        stderr.print(f"{row.label} @ depth {row.depth}: {ran}", markup=False)
        if row.error is None:
            stderr.print(f"  note: {row.note()}", markup=False)
