"""Data-parallel sweeps: a list of jobs spread over worker processes, each with its own copy of
the model (loaded from the arguments that loaded the caller's, `Model.load_args`), results back
in the jobs' order. Each worker runs with the caller's number of torch threads unless told
otherwise: how many threads split a product changes the order of its float sums (a fidelity KL
moved by 1e-5 between 1 and 2 threads), so the same count gives exactly one process's values; to
share C cores among N workers, run the caller with C/N threads. A timing sweep instead asks for
`split_cores`: each worker is then pinned to its own slice of the cores (`worker_cores`) and
runs 1/N of the caller's threads. On CUDA, a model loaded on `cuda` (no index) puts worker i on
cuda:(i mod the GPUs); `cuda:k` puts every worker there. Processes are spawned (never forked:
torch's thread pools do not survive a fork); a job's error comes back as that error."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any, TypeVar

import torch

from larql.errors import InvalidInput
from larql.models.model import LoadArgs, Model, load_model

Job = TypeVar("Job")
Result = TypeVar("Result")

_model: Model | None = None  # the worker process's copy


def worker_device(device: str, index: int, gpus: int) -> str:
    """Worker `index`'s device for a model loaded on `device` with `gpus` CUDA devices visible:
    a bare `cuda` spreads the workers round-robin over the GPUs; any other device (`cpu`, a
    named `cuda:k`) is every worker's."""
    if device == "cuda" and gpus > 0:
        return f"cuda:{index % gpus}"
    return device


def worker_cores(cores: Sequence[int], index: int, workers: int) -> list[int]:
    """Worker `index`'s share of `cores`: contiguous slices as even as they divide (the first
    ones one longer); every core where there are fewer cores than workers."""
    if len(cores) < workers:
        return list(cores)
    size, extra = divmod(len(cores), workers)
    start = index * size + min(index, extra)
    return list(cores[start : start + size + (index < extra)])


def shares_hardware(device: str, workers: int, gpus: int) -> bool:
    """Whether `workers` processes on `device` share the hardware they are timed on: on the CPU
    always (one memory bus and cache, even on their own cores); on CUDA unless each has a GPU."""
    if workers < 2:
        return False
    if device == "cuda":
        return gpus < workers
    return True


def _start_worker(
    args: LoadArgs, threads: int, split: bool, slots: Any, workers: int, gpus: int
) -> None:
    global _model
    index = slots.get()
    if split:  # a slice of the cores of its own, and its share of the threads
        cores = worker_cores(sorted(os.sched_getaffinity(0)), index, workers)
        os.sched_setaffinity(0, cores)
        threads = max(1, min(len(cores), threads // workers))
    torch.set_num_threads(threads)
    device = worker_device(args.device, index, gpus)
    _model = load_model(args.model, dtype=args.dtype, device=device, weights=args.weights)


def _run_job(work: Callable[[Model, Any], Any], job: Any) -> Any:
    assert _model is not None, "a worker runs jobs only after it loaded its model"
    return work(_model, job)


def in_workers(
    model: Model,
    work: Callable[[Model, Job], Result],
    jobs: Sequence[Job],
    workers: int,
    done: Callable[[int, Result], None] | None = None,
    split_cores: bool = False,
) -> list[Result]:
    """`work(model, job)` for every job, on `workers` processes (`work` a module-level
    function, jobs and results picklable) → the results in the jobs' order; `done(i, result)`
    is called as job i finishes (in the order they finish). `split_cores`: each worker pinned
    to its own slice of this process's cores and running its share of this process's threads
    (timings), instead of this process's thread count (values)."""
    if workers < 1:
        raise InvalidInput(f"workers must be ≥ 1, got {workers}")
    if model.load_args is None:
        raise InvalidInput("workers load the model again: give a model from larql.load_model")
    gpus = torch.cuda.device_count() if model.device.type == "cuda" else 0
    context = multiprocessing.get_context("spawn")
    slots = context.Queue()
    for index in range(workers):
        slots.put(index)
    threads = torch.get_num_threads()
    initargs = (model.load_args, threads, split_cores, slots, workers, gpus)
    results: dict[int, Result] = {}
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=initargs
    ) as pool:
        futures = {pool.submit(_run_job, work, job): i for i, job in enumerate(jobs)}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in sorted(finished, key=futures.__getitem__):
                if future.exception() is not None:
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise future.exception()  # type: ignore[misc]
                i = futures[future]
                results[i] = future.result()
                if done is not None:
                    done(i, results[i])
    return [results[i] for i in range(len(jobs))]


def spread(
    model: Model,
    work: Callable[[Model, Job], Result],
    jobs: Sequence[Job],
    workers: int,
    done: Callable[[int, Result], None] | None = None,
    split_cores: bool = False,
) -> list[Result]:
    """`in_workers` over `min(workers, len(jobs))` processes; with one, every job runs here on
    `model` (no second copy), through the same `work`, so both give the same values."""
    workers = min(workers, len(jobs))
    if workers > 1:
        return in_workers(model, work, jobs, workers, done, split_cores)
    results = []
    for i, job in enumerate(jobs):
        results.append(work(model, job))
        if done is not None:
            done(i, results[-1])
    return results
