"""Data-parallel sweeps: a list of jobs spread over worker processes, each with its own copy of
the model (loaded from the arguments that loaded the caller's, `Model.load_args`), results back
in the jobs' order. Each worker runs with the caller's number of torch threads: how many threads
split a product changes the order of its float sums (a fidelity KL moved by 1e-5 between 1 and 2
threads), so the same count gives exactly one process's values; to share C cores among N
workers, run the caller with C/N threads. Processes are spawned (never forked: torch's thread
pools do not survive a fork); a job's error comes back as that error."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

import torch

from larql.errors import InvalidInput
from larql.models.model import LoadArgs, Model, load_model

Job = TypeVar("Job")
Result = TypeVar("Result")

_model: Model | None = None  # the worker process's copy


def _start_worker(args: LoadArgs, threads: int) -> None:
    global _model
    torch.set_num_threads(threads)
    _model = load_model(args.model, dtype=args.dtype, device=args.device, weights=args.weights)


def _run_job(work: Callable[[Model, Any], Any], job: Any) -> Any:
    assert _model is not None, "a worker runs jobs only after it loaded its model"
    return work(_model, job)


def in_workers(
    model: Model,
    work: Callable[[Model, Job], Result],
    jobs: Sequence[Job],
    workers: int,
    done: Callable[[int], None] | None = None,
) -> list[Result]:
    """`work(model, job)` for every job, on `workers` processes (`work` a module-level
    function, jobs and results picklable) → the results in the jobs' order; `done(i)` is
    called as job i finishes."""
    if workers < 1:
        raise InvalidInput(f"workers must be ≥ 1, got {workers}")
    if model.load_args is None:
        raise InvalidInput("workers load the model again: give a model from larql.load_model")
    if model.device.type != "cpu":
        raise InvalidInput("workers run on the CPU for now (one process per GPU is not built)")
    threads = torch.get_num_threads()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(model.load_args, threads)
    ) as pool:
        futures = [pool.submit(_run_job, work, job) for job in jobs]
        results = []
        for i, future in enumerate(futures):
            results.append(future.result())
            if done is not None:
                done(i)
    return results
