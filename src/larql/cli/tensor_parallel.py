"""`--tensor-parallel N`: a command's run split over N processes (`larql.parallel`), each
holding its share of the model's heads and MLP. The checks that need no process come first,
in this one, so a size that does not divide the model is one line before anything starts."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

TensorParallelOption = Annotated[
    int,
    typer.Option(
        "--tensor-parallel",
        help="Split the model over N processes (gloo on the CPU, NCCL on cuda, one GPU each): "
        "each holds 1/N of every layer's query and K/V heads and of its MLP (or of each "
        "expert); N must divide them (SmolLM2-135M: 1 or 3). Under torchrun, N is its "
        "WORLD_SIZE.",
        metavar="N",
    ),
]


def wanted(size: int) -> bool:
    """Whether the command starts (or, under torchrun, joins) a tensor-parallel run: N > 1,
    or started by torchrun — and not already on a rank of one."""
    from larql.models.shard import TensorParallelError
    from larql.parallel.launch import current_shard, under_torchrun

    if size < 1:
        raise TensorParallelError(f"--tensor-parallel must be ≥ 1, got {size}")
    return (size > 1 or under_torchrun()) and current_shard() is None


def check_model(model: str | None, size: int) -> None:
    """The model's heads and MLP split `size` ways (its header read, not its weights)."""
    from larql.models.model import load_config
    from larql.models.shard import check_splits

    check_splits(load_config(model), size)


def check_engine(kind: Any) -> None:
    """An engine every rank can run: a live-decode one that writes no files (every rank
    would write the same ones). `kind`: an `EngineSpec`."""
    from larql.kv.catalog import parse_engine
    from larql.kv.spec import OperatorOnlyParameter, SpecPolicy
    from larql.models.shard import TensorParallelError

    kind.require_live_decode()
    try:
        parse_engine(kind.spec(), SpecPolicy(files=False))
    except OperatorOnlyParameter:
        raise TensorParallelError(
            f"--tensor-parallel does not run an engine that writes files ({kind.spec()}): "
            "every rank would write them"
        ) from None


def threads_per_rank(threads: int | None, size: int) -> int:
    """Torch CPU threads of each rank: --threads, else this process's cores shared out."""
    if threads is not None:
        return threads
    return max(1, len(os.sched_getaffinity(0)) // size)


def launch(size: int, task: Any, options: dict[str, Any], device: str) -> None:
    """Run `task` on every rank: here under torchrun, else on `size` new local processes;
    a failed run exits with its first failing rank's status (its error already written)."""
    from larql.models.shard import RankFailed
    from larql.parallel.launch import join_from_environment, leave_group, run_ranks, under_torchrun

    if under_torchrun():
        if device == "cuda":  # one GPU per process on each host
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
        shard = join_from_environment(size, device)
        try:
            task(shard, {**options, "device": device})
        except BaseException:
            leave_group(done=False)  # the other ranks fail too: no node waits on for this one
            raise
        if not leave_group():
            raise RankFailed("another rank of the tensor-parallel run did not finish")
        return
    status = run_ranks(size, task, options, device)
    if status:
        raise typer.Exit(status)
