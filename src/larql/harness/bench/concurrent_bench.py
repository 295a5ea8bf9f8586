"""`larql bench --concurrent N`: N sessions of one engine decoding at the same time, each on a
thread of its own, every one stepping alone (no batching: `--batch` measures that). What it
shows is how sessions that share the process's cores and weights slow each other down: the
aggregate tok/s over the slowest thread's time, and each stream's ms per token.

Every thread prefills and takes its warm-up steps, waits for the others, then times its steps."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import asdict, dataclass

from larql.harness.bench.engine_bench import BenchSettings
from larql.inference.errors import EngineError
from larql.inference.ffn import FfnBackend
from larql.inference.generation import GenerationSession
from larql.kv.spec import EngineSpec
from larql.models.model import Model


@dataclass
class ConcurrentRow:
    spec: str
    depth: int
    concurrent: int
    tok_s: float | None = None  # aggregate: every thread's steps over the slowest one's time
    ms_per_token: float | None = None  # per stream, the threads' median
    error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _one_kind(
    model: Model, ffn: FfnBackend, kind: EngineSpec, ids: list[int], s: BenchSettings, n: int
) -> tuple[list[float], str | None]:
    """→ (each thread's seconds for its timed steps, the first error if any)."""
    ready = threading.Barrier(n)
    elapsed: list[float] = []
    errors: list[str] = []

    def run() -> None:
        try:
            session = GenerationSession(
                kind.build(model),
                model,
                ffn,
                ids,
                s.warmup + s.new_tokens + 1,
                stop_ids=frozenset(),
            )
            session.prefill()
            for _ in range(s.warmup):
                session.step()
        except EngineError as e:
            errors.append(str(e))
            ready.abort()
            return
        try:
            ready.wait()
        except threading.BrokenBarrierError:
            return
        t0 = time.perf_counter()
        for _ in range(s.new_tokens):
            session.step()
        elapsed.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=run, name=f"bench-{i}") for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return elapsed, errors[0] if errors else None


def bench_concurrent(
    model: Model,
    ffn: FfnBackend,
    kinds: list[EngineSpec],
    ids: list[int],
    settings: BenchSettings,
    depth: int,
    concurrent: int,
) -> list[ConcurrentRow]:
    rows = []
    for kind in kinds:
        row = ConcurrentRow(kind.spec(), depth, concurrent)
        runs: list[tuple[float, float]] = []  # (aggregate tok/s, per-stream ms/token)
        for _ in range(settings.repeats):
            elapsed, error = _one_kind(model, ffn, kind, ids, settings, concurrent)
            if error is not None:
                row.error = error
                break
            runs.append(
                (
                    concurrent * settings.new_tokens / max(elapsed),
                    1000 * statistics.median(elapsed) / settings.new_tokens,
                )
            )
        if runs and row.error is None:
            row.tok_s = statistics.median(r[0] for r in runs)
            row.ms_per_token = statistics.median(r[1] for r in runs)
        rows.append(row)
    return rows
