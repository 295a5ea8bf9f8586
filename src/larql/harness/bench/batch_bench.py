"""`larql bench --batch 1,4,16`: B sessions of one engine decoding at once, the way the server's
continuous batching steps them. Per engine, batch size and depth: the aggregate tok/s (B tokens
per step), the per-stream ms per token (one step's time) and the memory each session holds.

Every session gets the same prompt; sessions whose engines batch (`batch_key`) take each step
together through `step_together` (one forward pass); the others step one after another, which
is what the server does with them. Runs are interleaved: every (engine, batch size) once per
round; medians over rounds."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from larql.harness.bench.engine_bench import BenchSettings
from larql.harness.bench.machine import sync
from larql.inference.batching import batch_groups
from larql.inference.errors import EngineError
from larql.inference.ffn import FfnBackend
from larql.inference.generation import GenerationSession, step_together
from larql.inference.lookahead import Lookahead, goes_ahead
from larql.kv.spec import EngineSpec
from larql.models.model import Model


@dataclass
class BatchRow:
    spec: str
    depth: int
    batch: int
    batched: bool | None = None  # the sessions took each step in one forward pass
    ahead: bool | None = None  # each step was queued before the one before it was read
    tok_s: float | None = None  # aggregate: batch × steps / time
    ms_per_token: float | None = None  # per stream: one step's time
    memory_per_session: int | None = None  # bytes an engine holds after the steps
    error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _one_run(
    model: Model, ffn: FfnBackend, kind: EngineSpec, ids: list[int], batch: int, s: BenchSettings
) -> tuple[float, bool, bool, int]:
    """→ (seconds for the timed steps, whether they batched, whether they went a step ahead,
    memory per session)."""
    steps = s.warmup + s.new_tokens
    sessions = [
        GenerationSession(kind.build(model), model, ffn, ids, steps + 1, stop_ids=frozenset())
        for _ in range(batch)
    ]
    for session in sessions:
        session.prefill()
    groups = [[sessions[i] for i in group] for group in batch_groups([x.engine for x in sessions])]

    ahead = {i: Lookahead() for i, group in enumerate(groups) if _goes_ahead(group)}

    def step() -> None:
        for i, group in enumerate(groups):
            if i in ahead:
                ahead[i].advance(group)
            elif len(group) > 1:
                step_together(group)
            else:
                group[0].step()

    for _ in range(s.warmup):
        step()
    sync(model.device)
    t0 = time.perf_counter()
    for _ in range(s.new_tokens):
        step()
    for lookahead in ahead.values():
        lookahead.drain()
    sync(model.device)
    elapsed = time.perf_counter() - t0
    batched = len(groups) == 1 and batch > 1
    return elapsed, batched, bool(ahead), sessions[0].engine.memory().total


def _goes_ahead(group: list[GenerationSession]) -> bool:
    """Batched steps go a step ahead on CUDA, as the server steps them there (on the CPU the
    host is the one computing: nothing to overlap)."""
    return len(group) > 1 and group[0].model.device.type == "cuda" and goes_ahead(group)


def bench_batches(
    model: Model,
    ffn: FfnBackend,
    kinds: list[EngineSpec],
    ids: list[int],
    settings: BenchSettings,
    depth: int,
    batches: list[int],
) -> list[BatchRow]:
    rows = {(k.spec(), b): BatchRow(k.spec(), depth, b) for k in kinds for b in batches}
    times: dict[tuple[str, int], list[float]] = {key: [] for key in rows}
    for _ in range(settings.repeats):
        for kind in kinds:
            for batch in batches:
                row = rows[kind.spec(), batch]
                if row.error is not None:
                    continue
                try:
                    elapsed, row.batched, row.ahead, row.memory_per_session = _one_run(
                        model, ffn, kind, ids, batch, settings
                    )
                except EngineError as e:
                    row.error = str(e)
                    continue
                times[kind.spec(), batch].append(elapsed)
    for key, row in rows.items():
        if times[key]:
            seconds = statistics.median(times[key])
            row.tok_s = row.batch * settings.new_tokens / seconds
            row.ms_per_token = 1000 * seconds / settings.new_tokens
    return list(rows.values())
