"""Starting the ranks of a tensor-parallel run and joining their group (torch.distributed: gloo
on the CPU, NCCL on CUDA).

`run_ranks` starts N processes on this machine (torch.multiprocessing's spawn), each joining
a group over localhost; under `torchrun` (its environment names RANK / WORLD_SIZE /
MASTER_ADDR) `join_from_environment` joins the group torchrun set up instead, which is how one
run spans several hosts. Every collective waits at most `timeout` for the other ranks, and the
parent ends every rank as soon as one of them ends with an error: a dead rank ends the run
with an error, never a hang. The ranks have a process group of their own: Ctrl-C and SIGTERM
reach the parent, which hands them to rank 0, and rank 0 ends the command.

A rank leaves its group in order (`leave_group`): a barrier, then the group destroyed while
the interpreter still runs, which joins its threads (gloo's workers and connection loop). A
group left to the interpreter's exit would end those threads then, and a worker that still
held a collective's tensors would abort the process (`terminate called`) — under torchrun,
whose agents then wait for a node that failed after its run succeeded."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from larql.errors import LarqlError
from larql.models.shard import DEFAULT_TIMEOUT, RankFailed, TensorParallelError, TensorShard

EXIT_USER_ERROR = 2
EXIT_FAILED = 1
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# A rank's work: given its shard and the command's options, run and write (rank 0) the result.
RankTask = Callable[[TensorShard, dict[str, Any]], None]

_current: TensorShard | None = None  # this process's shard, once it joined a group


def current_shard() -> TensorShard | None:
    """This process's place in the tensor-parallel group it joined (None: it runs alone): a
    command run again on a rank loads its share of the model through it."""
    return _current


def _joined(shard: TensorShard) -> TensorShard:
    global _current
    _current = shard
    return shard


def backend_for(device: str) -> str:
    """NCCL for CUDA devices, gloo for the CPU."""
    return "nccl" if device.startswith("cuda") else "gloo"


def under_torchrun() -> bool:
    """Whether torchrun (or another launcher of torch.distributed's env:// rendezvous) started
    this process as one rank of a group."""
    return all(name in os.environ for name in _TORCHRUN_VARIABLES)


def join_from_environment(
    world: int, device: str, timeout: timedelta = DEFAULT_TIMEOUT
) -> TensorShard:
    """This process's shard in the group torchrun set up (its WORLD_SIZE must be `world`)."""
    size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if size != world:
        raise TensorParallelError(
            f"--tensor-parallel {world} under torchrun needs {world} processes in all, "
            f"torchrun started {size} (--nnodes × --nproc-per-node)"
        )
    _quiet_unless_first(rank)
    _init_group(backend_for(device), "env://", rank, size, timeout, device)
    return _joined(TensorShard(rank, size))


def _quiet_unless_first(rank: int) -> None:
    """Rank 0 alone writes the command's output: another rank's stdout goes nowhere."""
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the process's life)


def leave_group(done: bool = True) -> bool:
    """Close this process's group → whether every rank was there. `done`: this rank finished
    its work, and waits (at most the collectives' timeout) until every rank has; otherwise
    (it failed) it leaves at once, and the others' next collective fails now instead of at
    their timeout. Either way the group is destroyed here, which ends its threads: the shards
    name the default group and hold no reference that would keep it (and them) alive."""
    global _current
    _current = None
    if not dist.is_initialized():
        return True
    together = True
    if done:
        try:
            dist.barrier()
        except (RuntimeError, dist.DistError):
            together = False
    try:
        dist.destroy_process_group()
    except (RuntimeError, dist.DistError):
        together = False
    return together


def _init_group(
    backend: str, init_method: str, rank: int, world: int, timeout: timedelta, device: str
) -> None:
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local % torch.cuda.device_count())
    try:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout
        )
    except (RuntimeError, ValueError, dist.DistError) as e:
        raise RankFailed(f"rank {rank} could not join the tensor-parallel group: {e}") from e


def rank_device(device: str, rank: int) -> str:
    """The device rank `rank` runs on: its own GPU under `cuda` (cuda:rank), else `device`."""
    return f"cuda:{rank % torch.cuda.device_count()}" if device == "cuda" else device


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (the group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    world: int,
    task: RankTask,
    options: dict[str, Any],
    device: str = "cpu",
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> int:
    """Run `task` on `world` new processes (ranks 0..world-1 of one group over localhost) →
    the run's exit status: 0, or the first failing rank's (its error line written by it).
    A rank that ends with an error or a signal ends the others at once."""
    context = mp.get_context("spawn")
    port = free_port()
    ranks = [
        context.Process(
            target=_rank_main,
            args=(rank, world, port, device, timeout.total_seconds(), task, options),
            name=f"larql-rank-{rank}",
        )
        for rank in range(world)
    ]
    for process in ranks:
        process.start()
    previous = _forward_signals(ranks[0])
    try:
        return _wait(ranks)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for process in ranks:
            if process.is_alive():
                process.terminate()
        for process in ranks:
            process.join(timeout=10)


def _forward_signals(first: Any) -> dict[int, Any]:
    """Ctrl-C and SIGTERM go to rank 0 alone (the ranks have a process group of their own, out
    of the terminal's reach): it ends the command as one process would — `larql serve` ends
    its sessions and then tells the other ranks to stop; another command's rank 0 exits and
    `_wait` ends the rest. → the handlers they replace (none off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(sig: int, _: object) -> None:
        if first.pid is not None and first.exitcode is None:
            os.kill(first.pid, sig)

    return {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}


def _wait(ranks: list) -> int:  # (multiprocessing's SpawnProcess)
    while True:
        ended = [p for p in ranks if p.exitcode is not None]
        failed = [p for p in ended if p.exitcode != 0]
        if failed:
            first = failed[0]
            if first.exitcode < 0:  # killed by a signal: it wrote nothing
                sys.stderr.write(
                    f"error: tensor-parallel {first.name} ended by signal {-first.exitcode}; "
                    "the run stopped\n"
                )
                return EXIT_FAILED
            return first.exitcode
        if len(ended) == len(ranks):
            return 0
        time.sleep(0.02)


def _end_with_parent() -> None:
    """On Linux, a rank gets SIGTERM when its launcher dies, however it died (a `kill -9`
    too): no rank runs on alone (a server's rank 0 would go on serving)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _rank_main(
    rank: int,
    world: int,
    port: int,
    device: str,
    timeout_s: float,
    task: RankTask,
    options: dict[str, Any],
) -> None:
    """One spawned rank: join the group, run the task, leave; an error is one line on stderr
    (rank 0's as the command's own, another rank's naming it) and the exit status."""
    status = 0
    os.setpgrp()  # the terminal's Ctrl-C reaches the parent, which hands it to rank 0
    # what the parent hands over is meant (a parent started in the background ignores SIGINT,
    # and its children would inherit that)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _end_with_parent()
    try:
        own = rank_device(device, rank)
        if own.startswith("cuda"):
            os.environ["LOCAL_RANK"] = str(rank)
        timeout = timedelta(seconds=timeout_s)
        _quiet_unless_first(rank)
        _init_group(backend_for(own), f"tcp://127.0.0.1:{port}", rank, world, timeout, own)
        task(_joined(TensorShard(rank, world)), {**options, "device": own})
    except KeyboardInterrupt:
        status = 130
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else EXIT_FAILED
    except LarqlError as e:
        sys.stderr.write(f"error: {e}\n" if rank == 0 else f"error: rank {rank}: {e}\n")
        status = EXIT_USER_ERROR
    except Exception as e:  # a rank's failure is one line, never a traceback
        code = getattr(e, "exit_code", None)  # a command's own exit (typer's), its line written
        if isinstance(code, int):
            status = code
        else:
            sys.stderr.write(
                f"error: tensor-parallel rank {rank} failed: {type(e).__name__}: {e}\n"
            )
            status = EXIT_FAILED
    sys.stdout.flush()
    sys.stderr.flush()
    if status == 0 and not leave_group():
        status = EXIT_FAILED
    # no interpreter teardown: after an error the group is still up (another thread of the
    # rank may be in a collective, and the others waiting in one): leave at once
    os._exit(status)
