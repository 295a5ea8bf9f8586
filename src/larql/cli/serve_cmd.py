"""`larql serve`: the OpenAI-compatible server (or, with --ffn-only, an FFN shard)."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from larql.cli.common import InvalidInput, open_model, stderr, user_errors
from larql.cli.options import (
    DeviceOption,
    DtypeOption,
    ModelOption,
    ThreadsOption,
    WeightsOption,
    parse_layer_range,
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
    from larql.inference.engine import Engine
    from larql.models.model import Model
    from larql.models.shard import TensorShard
    from larql.server.settings import ServerSettings


@user_errors
def serve(
    model: ModelOption = None,
    engine: Annotated[
        str | None,
        typer.Option("--engine", help="Default engine spec; a request may name its own."),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0 = any free port).")] = 8080,
    max_sessions: Annotated[
        int, typer.Option("--max-sessions", help="Sessions decoding at once.")
    ] = 4,
    max_queue: Annotated[
        int, typer.Option("--max-queue", help="Requests waiting behind them; beyond: 429.")
    ] = 16,
    max_prompt_tokens: Annotated[
        int | None,
        typer.Option("--max-prompt-tokens", help="Longest prompt accepted (default: context)."),
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", help="Largest max_tokens a request may ask.")
    ] = 512,
    request_timeout: Annotated[
        float, typer.Option("--request-timeout", help="Seconds a request may take, queue included.")
    ] = 300.0,
    prefill_chunk: Annotated[
        int,
        typer.Option(
            "--prefill-chunk",
            help="While other streams decode, new prompts go in at most this many tokens a "
            "step: riding in the streams' own step where their engines batch (in chunks "
            "where the engine extends a prefill exactly — standard, markov-rs — else a whole "
            "prompt that fits), else in a turn between their steps; a decode step that "
            "recomputes the whole context (no-cache) goes in parts of as many rows.",
        ),
    ] = 32,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            "--shutdown-timeout",
            help="Seconds running streams may go on after SIGTERM / Ctrl-C before they end with "
            "an error event (new requests are refused at once; a second signal ends them now).",
        ),
    ] = 10.0,
    prefix_cache_bytes: Annotated[
        str | None,
        typer.Option(
            "--prefix-cache-bytes",
            help="Bytes of engine states kept for prompts that start alike (e.g. 1G, 512M; "
            "0: no prefix cache; default: an eighth of the memory the states live in — the "
            "GPU's or the host's).",
        ),
    ] = None,
    quiet: Annotated[
        bool,
        typer.Option(
            "-q",
            "--quiet",
            help="No access log (else one line on stderr per request: method, path, status, "
            "milliseconds, engine).",
        ),
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "-v",
            "--verbose",
            help="At start, the model and engine served and the limits; each access-log line "
            "adds what the request ran (prompt, cached and new tokens, decode path); the "
            "server's debug log (sessions starting and ending) on stderr.",
        ),
    ] = False,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    weights: WeightsOption = "auto",
    threads: ThreadsOption = None,
    ffn_only: Annotated[
        bool, typer.Option("--ffn-only", help="Serve the FFN of some layers as a shard.")
    ] = False,
    layers: Annotated[
        str | None, typer.Option("--layers", help="With --ffn-only: layers A-B (inclusive).")
    ] = None,
    experts: Annotated[
        str | None,
        typer.Option(
            "--experts",
            help="With --ffn-only, on a mixture-of-experts model: serve experts A-B (inclusive) "
            "of its MoE layers, for clients' --moe-shards.",
        ),
    ] = None,
    tensor_parallel: TensorParallelOption = 1,
) -> None:
    """Serve the model over HTTP: OpenAI completions and chat, decoded through the KV engines."""
    options = dict(locals())
    del options["tensor_parallel"]
    if not 0 <= port <= 65535:
        raise InvalidInput(f"--port must be in 0..65535, got {port}")
    if ffn_only:
        if tensor_parallel_wanted(tensor_parallel):
            from larql.models.shard import TensorParallelError

            raise TensorParallelError("--tensor-parallel serves the whole model; not --ffn-only")
        layer_range = parse_layer_range(layers) if layers is not None else None
        expert_range = parse_layer_range(experts, "--experts") if experts is not None else None
        lm = open_model(model, dtype, device, threads, weights)
        if verbose:
            debug_log()
            stderr.print(model_line(lm), markup=False)
        from larql.server.ffn_shard import run_ffn_shard

        run_ffn_shard(lm, layer_range, host, port, expert_range)
        return
    if layers is not None or experts is not None:
        raise InvalidInput("--layers and --experts apply to an FFN shard only (add --ffn-only)")
    check_limits(max_sessions, max_queue, max_prompt_tokens, max_new_tokens, request_timeout)
    if prefill_chunk < 1:
        raise InvalidInput(f"--prefill-chunk must be ≥ 1, got {prefill_chunk}")
    if not 0 <= shutdown_timeout < float("inf"):
        raise InvalidInput(f"--shutdown-timeout must be ≥ 0 seconds, got {shutdown_timeout}")
    cache_bytes = parse_size(prefix_cache_bytes) if prefix_cache_bytes is not None else None
    from larql.kv.resolve import resolve_engine

    choice = resolve_engine(engine)
    choice.engine.require_live_decode()
    if tensor_parallel_wanted(tensor_parallel):
        _check_tensor_parallel(choice.engine, cache_bytes, model, tensor_parallel)
        options["threads"] = threads_per_rank(threads, tensor_parallel)
        launch(tensor_parallel, _rank_serve, options, device)
        return
    from larql.parallel.launch import current_shard

    shard = current_shard()
    if shard is not None and shard.world == 1:  # a group of one serves as a process alone
        shard = None
    if shard is not None:
        cache_bytes = 0  # (refused above where asked for: a cached state would be rank 0's)
    lm = open_model(model, dtype, device, threads, weights)
    built = choice.engine.build(lm)  # a spec that cannot be built fails now, not per request
    if shard is not None and shard.rank != 0:
        from larql.server.tensor_parallel import follow

        follow(lm, shard)
        return

    from larql.server.app import create_app
    from larql.server.runner import serve_forever
    from larql.server.settings import ServerSettings
    from larql.server.tensor_parallel import MirroredSteps

    settings = ServerSettings(
        default_engine=choice.engine,
        max_sessions=max_sessions,
        max_queue=max_queue,
        max_prompt_tokens=max_prompt_tokens,
        max_new_tokens=max_new_tokens,
        request_timeout_s=request_timeout,
        prefill_chunk=prefill_chunk,
        shutdown_timeout_s=shutdown_timeout,
        model_aliases=(model,) if model and model != lm.name else (),
        access_log=not quiet,
        verbose=verbose,
        prefix_cache_bytes=cache_bytes,
    )
    if verbose:
        debug_log()

    def announce(url: str) -> None:
        ranks = f", {shard.world} tensor-parallel ranks" if shard is not None else ""
        stderr.print(
            f"larql serve: {lm.name} on {url}  (engine {choice.engine.spec()} from "
            f"{choice.source}, {max_sessions} sessions, queue {max_queue}{ranks})"
        )
        if verbose:
            for line in served_facts(lm, built, settings):
                stderr.print(line, markup=False)

    steps = MirroredSteps(shard) if shard is not None else None
    try:
        serve_forever(create_app(lm, settings, steps), host, port, announce)
    finally:
        if steps is not None:  # the other ranks wait for rank 0's word (once the loop ran, said)
            steps.finish()


def _check_tensor_parallel(
    kind: object, cache_bytes: int | None, model: str | None, size: int
) -> None:
    """What a tensor-parallel server refuses, before any process starts."""
    from larql.models.shard import TensorParallelError

    if cache_bytes:
        raise TensorParallelError(
            "--tensor-parallel keeps no prefix cache (a cached state would be rank 0's share "
            "alone); leave out --prefix-cache-bytes or give 0"
        )
    check_engine(kind)
    check_model(model, size)


def _rank_serve(shard: TensorShard, options: dict) -> None:
    """One rank of `larql serve --tensor-parallel`: rank 0 serves and schedules, the others
    follow its model calls (`larql.server.tensor_parallel`)."""
    serve(**options)


def debug_log() -> None:
    """`-v`: larql's own log (the server's sessions, the scheduler's notes) at debug level."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
    logger = logging.getLogger("larql")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)


def model_line(lm: Model) -> str:
    """The model and how its weights are read, as `larql run -v`'s decode path names them."""
    from larql.inference.linear import reads_blocks

    dtype = str(lm.dtype).removeprefix("torch.")
    weights = "weights in GGUF blocks" if reads_blocks(lm) else "weights dequantised"
    config = lm.config
    return (
        f"model: {lm.name} · {config.num_layers} layers · context {config.max_positions} · "
        f"{lm.device.type} · {dtype} · {weights}"
    )


def served_facts(lm: Model, engine: Engine, settings: ServerSettings) -> list[str]:
    """`-v`'s lines at start: the model, the default engine, the limits, the prefix cache."""
    from larql.inference.memory import mib
    from larql.inference.prefix_cache import default_size

    cache = settings.prefix_cache_bytes
    cache = default_size(lm) if cache is None else cache
    longest = settings.max_prompt_tokens or lm.config.max_positions - 1
    return [
        model_line(lm),
        f"engine: {engine.info().label}: {engine.describe()}",
        f"limits: prompts up to {longest} tokens, up to {settings.max_new_tokens} new tokens, "
        f"{settings.request_timeout_s:g} s a request; beside decoding streams a prompt goes "
        f"in {settings.prefill_chunk} tokens a step",
        f"prefix cache: {mib(cache)} of engine states" if cache else "prefix cache: off",
        "log: each request's line adds prompt=, cached=, new= and its decode path",
    ]


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """'0', '123456', '512M', '1G', '1.5GiB' → bytes (K/M/G/T are powers of 1024)."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in _UNITS else ""
    try:
        value = float(raw[: len(raw) - len(unit)])
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise InvalidInput(
            f"--prefix-cache-bytes: not a size: {text!r} (accepted: bytes, or a number with "
            "K, M, G or T, e.g. 512M; 0 turns the cache off)"
        )
    return int(value * _UNITS[unit])


def check_limits(
    max_sessions: int,
    max_queue: int,
    max_prompt_tokens: int | None,
    max_new_tokens: int,
    request_timeout: float,
) -> None:
    if max_sessions < 1:
        raise InvalidInput(f"--max-sessions must be ≥ 1, got {max_sessions}")
    if max_queue < 0:
        raise InvalidInput(f"--max-queue must be ≥ 0, got {max_queue}")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise InvalidInput(f"--max-prompt-tokens must be ≥ 1, got {max_prompt_tokens}")
    if max_new_tokens < 1:
        raise InvalidInput(f"--max-new-tokens must be ≥ 1, got {max_new_tokens}")
    if not request_timeout > 0:
        raise InvalidInput(f"--request-timeout must be > 0, got {request_timeout}")
