"""`larql run`: generate from a prompt through any live-decode engine, streaming the text."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from larql.cli.common import InvalidInput, open_model, read_prompt, stderr, stdout, user_errors
from larql.cli.ffn_options import (
    FfnDispatchOption,
    FfnPolicyOption,
    FfnTimeoutOption,
    FfnUrlOption,
    MoeShardsOption,
    check_policy,
    ffn_policy_spec,
)
from larql.cli.options import DeviceOption, DtypeOption, ModelOption, ThreadsOption, WeightsOption
from larql.cli.renamed import output_format
from larql.cli.state_options import (
    LoadStateOption,
    ResumeOption,
    SaveStateOption,
    check_state_directory,
    describe_state,
)
from larql.cli.tensor_parallel import (
    TensorParallelOption,
    check_engine,
    check_model,
    launch,
    threads_per_rank,
)
from larql.cli.tensor_parallel import wanted as tensor_parallel_wanted

if TYPE_CHECKING:  # torch loads in the command's body, not for `--help`
    from larql.api.generation import Generation
    from larql.models.shard import TensorShard

OUTPUTS = ("text", "json")


def top_table(rows: tuple) -> Table:
    """The next-token table: rank, token, id, probability, logit."""
    table = Table(title="next token after the prompt")
    for name in ("#", "token", "id", "probability", "logit"):
        table.add_column(name, justify="left" if name == "token" else "right")
    for rank, row in enumerate(rows, 1):
        table.add_row(
            str(rank),
            repr(row.text),
            str(row.token_id),
            f"{row.probability:.4f}",
            f"{row.logit:.3f}",
        )
    return table


@user_errors
def run(
    prompt: Annotated[
        str,
        typer.Argument(
            help="Prompt text, or - to read it from stdin (may be empty with --load-state or "
            "--resume)."
        ),
    ] = "",
    model: ModelOption = None,
    max_tokens: Annotated[int, typer.Option("-n", "--max-tokens", help="New tokens.")] = 64,
    engine: Annotated[
        str | None, typer.Option("--engine", help="Engine spec, e.g. standard:window=512.")
    ] = None,
    kv_cache: Annotated[
        str, typer.Option("--kv-cache", help="Legacy: standard|markov-bounded|none.")
    ] = "standard",
    context_window: Annotated[
        int, typer.Option("--context-window", help="Legacy window for --kv-cache markov-bounded.")
    ] = 0,
    chat: Annotated[
        bool, typer.Option("--chat", help="Wrap the prompt in the chat template.")
    ] = False,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = no limit.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Seed for sampling.")] = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    weights: WeightsOption = "auto",
    threads: ThreadsOption = None,
    output: Annotated[str, typer.Option("--output", "-o", help="text or json.")] = "text",
    ffn_policy: FfnPolicyOption = None,
    ffn: FfnUrlOption = None,
    ffn_timeout_secs: FfnTimeoutOption = None,
    ffn_dispatch: FfnDispatchOption = None,
    moe_shards: MoeShardsOption = None,
    top: Annotated[
        int,
        typer.Option(
            "--top",
            help="Also print the N most likely next tokens after the prompt, with their "
            "probabilities (the model's, whatever the sampling).",
        ),
    ] = 0,
    save_state: SaveStateOption = None,
    load_state_dir: LoadStateOption = None,
    resume: ResumeOption = None,
    tensor_parallel: TensorParallelOption = 1,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Generate text from PROMPT with the chosen KV engine."""
    options = dict(locals())
    del options["tensor_parallel"]
    # the checks that need no torch first: a typo is answered at once
    options["output"] = output_format(output, OUTPUTS)
    if max_tokens < 1:
        raise InvalidInput(f"-n/--max-tokens must be ≥ 1, got {max_tokens}")
    if top < 0:
        raise InvalidInput(f"--top must be ≥ 0, got {top}")
    if resume is not None and load_state_dir is not None:
        raise InvalidInput("give --resume or --load-state, not both")
    from larql.inference.sampling import SamplingParams

    SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)  # checks early
    check_state_directory(save_state)
    if tensor_parallel_wanted(tensor_parallel):
        _check_tensor_parallel(options, tensor_parallel)
        options["threads"] = threads_per_rank(threads, tensor_parallel)
        options["prompt"] = read_prompt(prompt)  # stdin is this process's
        launch(tensor_parallel, _rank_run, options, device)
        return
    _run(None, **options)


def _check_tensor_parallel(options: dict, size: int) -> None:
    """What a tensor-parallel run refuses, before any process starts."""
    from larql.kv.resolve import resolve_engine
    from larql.models.shard import TensorParallelError

    for flag, key in (
        ("--save-state", "save_state"),
        ("--load-state", "load_state_dir"),
        ("--resume", "resume"),
    ):
        if options[key] is not None:
            raise TensorParallelError(f"--tensor-parallel does not take {flag} (a state is whole)")
    for flag, key in (
        ("--ffn-policy", "ffn_policy"),
        ("--ffn", "ffn"),
        ("--moe-shards", "moe_shards"),
    ):
        if options[key] is not None:
            raise TensorParallelError(
                f"--tensor-parallel runs the model's own dense MLP, split; it does not take {flag}"
            )
    choice = resolve_engine(options["engine"], options["kv_cache"], options["context_window"])
    check_engine(choice.engine)
    check_model(options["model"], size)


def _rank_run(shard: TensorShard, options: dict) -> None:
    """One rank of `larql run --tensor-parallel`."""
    _run(shard, **options)


def _run(
    shard: TensorShard | None,
    prompt: str,
    model: str | None,
    max_tokens: int,
    engine: str | None,
    kv_cache: str,
    context_window: int,
    chat: bool,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    device: str,
    dtype: str,
    weights: str,
    threads: int | None,
    output: str,
    ffn_policy: str | None,
    ffn: str | None,
    ffn_timeout_secs: float | None,
    ffn_dispatch: str | None,
    moe_shards: str | None,
    top: int,
    save_state: Path | None,
    load_state_dir: Path | None,
    resume: str | None,
    verbose: bool,
) -> None:
    """The command's body, in one process or on one rank of a tensor-parallel run (whose
    rank 0 alone writes)."""
    writes = shard is None or shard.rank == 0
    from larql.api import generate
    from larql.kv.resolve import resolve_engine

    ffn_spec = ffn_policy_spec(
        ffn_policy, ffn, timeout=ffn_timeout_secs, moe_shards=moe_shards, dispatch=ffn_dispatch
    )
    check_policy(ffn_spec)
    choice = resolve_engine(engine, kv_cache, context_window)
    choice.engine.require_live_decode()
    for warning in choice.warnings if writes else ():
        stderr.print(f"warning: {warning}")
    continues = load_state_dir is not None or resume is not None
    text = read_prompt(prompt) if not continues or prompt.strip() else ""
    lm = open_model(model, dtype, device, threads, weights, shard)
    # a loaded state keeps the engine it was saved with unless --engine names one
    asked = choice.engine if load_state_dir is None or choice.source != "default" else None

    pieces: list[str] = []

    def write(piece: str) -> None:
        pieces.append(piece)
        if output == "text" and writes:
            sys.stdout.write(piece)
            sys.stdout.flush()

    try:
        result = generate(
            lm,
            asked,
            text,
            max_new_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            chat=chat,
            ffn_policy=ffn_spec,
            on_text=write,
            load_state=load_state_dir,
            save_state=save_state,
            top=top,
            resume=resume,
        )
    except KeyboardInterrupt:  # Ctrl-C: what was generated so far, then exit 130
        if not writes:
            raise
        if output == "json":
            engine_shown = asked.spec() if asked is not None else "(the loaded state's)"
            partial = {
                "model": lm.name,
                "engine": engine_shown,
                "text": "".join(pieces),
                "finish_reason": "interrupted",
            }
            print(json.dumps(partial))
        else:
            sys.stdout.write("\n")
        sys.stdout.flush()
        raise
    if writes:
        _write_result(result, output, verbose, choice.source)


def _write_result(result: Generation, output: str, verbose: bool, source: str) -> None:
    """The run's end: the text's line end or the JSON, the state notices, --top, -v."""
    if output == "text":  # the text's line ends before any notice on stderr
        sys.stdout.write("\n")
        sys.stdout.flush()
    if result.loaded_state is not None:
        stderr.print(describe_state("loaded", result.loaded_state))
    if result.resumed is not None:
        stderr.print(result.resumed.describe(), markup=False)
    if result.saved_state is not None:
        stderr.print(describe_state("saved", result.saved_state))
    if output == "json":
        print(json.dumps(result.as_json()))
    elif result.top:
        stdout.print(top_table(result.top))
    if verbose:
        rate = result.decode_tok_s
        stderr.print(f"engine: {result.engine_summary}  (from {source})")
        stderr.print(f"ffn: {result.ffn}")
        stderr.print(f"decode path: {result.decode_path}", markup=False)
        stderr.print(
            f"prompt tokens: {len(result.prompt_ids)}   generated: {len(result.token_ids)}"
        )
        stderr.print(
            f"prefill: {result.prefill_ms:.1f} ms   decode: "
            + (f"{rate:.1f} tok/s" if rate else "n/a (one token)")
        )
        stderr.print(f"engine memory: {result.memory_breakdown.describe()}")
        stderr.print(f"finish: {result.finish_reason}")
