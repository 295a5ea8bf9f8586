"""Timing engines: prefill (+ first pick), then `warmup + tokens` decode steps, each a whole
token (forward + logits + pick) as the generation loop runs it, split into forward and head
(`step_timer`); memory after decode; roofline.

Engines compared in one run are timed in rounds: every engine once per repeat, so a machine
whose speed drifts over minutes (a GPU host's launch overhead swung 5-10x between passes)
moves all of them alike instead of whichever ran during the slow stretch."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from larql.harness.bench.machine import peak_above_resident, sync
from larql.harness.bench.stats import StepStats
from larql.harness.bench.step_timer import StepTimer
from larql.inference.decode_path import decode_path
from larql.inference.errors import EngineError
from larql.inference.ffn import FfnBackend
from larql.inference.generation import next_token_logits
from larql.inference.linear import reads_blocks
from larql.inference.memory import MemoryBreakdown, mib_value
from larql.inference.sampling import greedy_token
from larql.kernels.ran import recording
from larql.kv.spec import EngineSpec
from larql.models.model import Model


@dataclass(frozen=True)
class BenchSettings:
    new_tokens: int = 32
    warmup: int = 3
    repeats: int = 3
    profile: bool = False


@dataclass
class EngineRow:
    """One engine at one depth. Times in ms; memory in bytes; None where nothing was measured."""

    spec: str
    label: str
    depth: int
    prompt_tokens: int
    prefill_ms: float | None = None
    step: StepStats | None = None
    fwd_ms: float | None = None
    head_ms: float | None = None
    tok_s: float | None = None
    tok_s_runs: list[float] = field(default_factory=list)
    memory: MemoryBreakdown | None = None
    context_tokens: int = 0  # prompt + generated: the length the memory was measured at
    fp16_full_bytes: int = 0
    weight_read_bytes: int = 0
    bandwidth_gbs: float = 0.0
    # CUDA: the highest a run's allocations rose above what was resident when it began (state,
    # growth reserve, workspace, captured graphs, activations; weights excluded), over the runs
    peak_working_bytes: int | None = None
    # CUDA: what stays allocated above the resident weights once the run has decoded (the
    # engine's live state: what eviction really frees shows here), the largest over the runs
    held_bytes: int | None = None
    stages: dict[str, float] | None = None
    wire_bytes_per_tok: float = 0.0  # FFN bytes over the network per timed step (0: local)
    dispatch: str | None = None  # the engine's dispatch path (per-layer, cuda-graph, …)
    # what the timed decode steps ran: device · dtype · weights · kernel path (`decode_path`)
    decode_path: str | None = None
    error: str | None = None

    @property
    def bytes_per_token(self) -> float | None:
        """State bytes (growth reserve left out) per token of context."""
        if self.memory is None or self.memory.state == 0 or not self.context_tokens:
            return None
        return self.memory.state / self.context_tokens

    @property
    def ratio_vs_fp16_full(self) -> float | None:
        """State bytes over an fp16 K/V cache of the same length (reserve shown apart)."""
        if self.memory is None or self.memory.state == 0 or not self.fp16_full_bytes:
            return None
        return self.memory.state / self.fp16_full_bytes

    @property
    def achieved_gbs(self) -> float | None:
        """(weights read per token + engine state) × tok/s: the state is read once per step by
        attention, so this is exact for `standard` and an estimate for the other engines."""
        if self.tok_s is None or self.memory is None:
            return None
        return (self.weight_read_bytes + self.memory.state) * self.tok_s / 1e9

    @property
    def bandwidth_share(self) -> float | None:
        gbs = self.achieved_gbs
        return gbs / self.bandwidth_gbs if gbs is not None and self.bandwidth_gbs else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "label": self.label,
            "depth": self.depth,
            "prompt_tokens": self.prompt_tokens,
            "prefill_ms": self.prefill_ms,
            "decode_ms": self.step.as_dict() if self.step else None,
            "fwd_ms": self.fwd_ms,
            "head_ms": self.head_ms,
            "tok_s": self.tok_s,
            "tok_s_runs": self.tok_s_runs,
            "memory": None
            if self.memory is None
            else {
                "hot": self.memory.hot,
                "cold": self.memory.cold,
                "derivative": self.memory.derivative,
                "reserved": self.memory.reserved,
                "state": self.memory.state,
                "total": self.memory.total,
            },
            "context_tokens": self.context_tokens,
            "bytes_per_token": self.bytes_per_token,
            "fp16_full_bytes": self.fp16_full_bytes,
            "ratio_vs_fp16_full": self.ratio_vs_fp16_full,
            "achieved_gbs": self.achieved_gbs,
            "bandwidth_share": self.bandwidth_share,
            "peak_working_bytes": self.peak_working_bytes,
            "held_bytes": self.held_bytes,
            "stages": self.stages,
            "decode_path": self.decode_path,
            "error": self.error,
            # the fields LARQL's own bench results carry, for readers of that format
            "backend": self.label,
            "ms_per_tok": None
            if self.step is None
            else {"mean": self.step.mean, "p50": self.step.p50, "p99": self.step.p99},
            "tok_per_s": self.tok_s,
            "wire_bytes_per_tok": self.wire_bytes_per_tok,
            "n_steps": 0 if self.step is None else self.step.n,
            "note": self.note(),
        }

    def note(self) -> str:
        """`[dispatch] fwd=… head=…  hot=…MiB cold=…MiB deriv=…MiB reserve=…MiB  R× vs std-kv`:
        the table's memory cells (`MemoryBreakdown`'s tiers and reserve, 2 decimals) and the
        state over an fp16 K/V cache of the same length (std-kv; none where the engine holds no
        state)."""
        if self.error is not None:
            return self.error
        parts = f"[{self.dispatch}] " if self.dispatch else ""
        if self.fwd_ms is not None and self.head_ms is not None:
            parts += f"fwd={self.fwd_ms:.2f}ms head={self.head_ms:.2f}ms  "
        if self.memory is None:
            return parts.rstrip()
        m = self.memory
        tiers = (("hot", m.hot), ("cold", m.cold), ("deriv", m.derivative), ("reserve", m.reserved))
        parts += " ".join(f"{name}={mib_value(n):.2f}MiB" for name, n in tiers) + "  "
        ratio = self.ratio_vs_fp16_full
        if ratio is None:
            return parts + "engine state not held here"
        return parts + (f"{ratio:.1f}× vs std-kv" if ratio < 10 else f"{ratio:.0f}× vs std-kv")


@dataclass
class _Samples:
    """One engine's measurements, run by run."""

    prefill_ms: list[float] = field(default_factory=list)
    fwd: list[float] = field(default_factory=list)
    head: list[float] = field(default_factory=list)
    whole: list[float] = field(default_factory=list)
    wire: list[float] = field(default_factory=list)  # FFN network bytes per step, run by run
    # from the last run; the engine itself is dropped after each run, so engines timed in
    # rounds do not hold each other's state
    memory: MemoryBreakdown | None = None
    label: str = ""
    dispatch: str | None = None
    stages: dict[str, float] | None = None
    decode_kinds: set[str] = field(default_factory=set)  # what the timed steps ran
    decode_steps: int = 0


def bench_engine(
    model: Model,
    ffn: FfnBackend,
    kind: EngineSpec,
    prompt_ids: list[int],
    settings: BenchSettings,
    depth: int = 0,
    bandwidth_gbs: float = 0.0,
) -> EngineRow:
    return bench_engines(model, ffn, [kind], prompt_ids, settings, depth, bandwidth_gbs)[0]


def bench_engines(
    model: Model,
    ffn: FfnBackend,
    kinds: list[EngineSpec],
    prompt_ids: list[int],
    settings: BenchSettings,
    depth: int = 0,
    bandwidth_gbs: float = 0.0,
) -> list[EngineRow]:
    """Every engine of `kinds` on the same prompt, `settings.repeats` rounds of one run each:
    run i of every engine happens in round i (`tok_s_runs[i]`)."""
    rows = [
        EngineRow(
            spec=kind.spec(),
            label=kind.spec(),
            depth=depth,
            prompt_tokens=len(prompt_ids),
            weight_read_bytes=model.weights.decode_read_bytes(
                reads_blocks(model), model.config.experts_per_token
            ),
            bandwidth_gbs=bandwidth_gbs,
        )
        for kind in kinds
    ]
    samples = [_Samples() for _ in kinds]
    for _ in range(settings.repeats):
        for kind, row, sample in zip(kinds, rows, samples, strict=True):
            if row.error is not None:
                continue
            try:
                _run_once(model, ffn, kind, prompt_ids, settings, row, sample)
            except EngineError as e:
                row.error = f"{type(e).__name__}: {e}"
    for row, sample in zip(rows, samples, strict=True):
        if row.error is None:
            _summarise(model, prompt_ids, settings, row, sample)
    return rows


def _run_once(
    model: Model,
    ffn: FfnBackend,
    kind: EngineSpec,
    prompt_ids: list[int],
    settings: BenchSettings,
    row: EngineRow,
    sample: _Samples,
) -> None:
    device = model.device
    with peak_above_resident(device) as peak, torch.inference_mode():
        engine = kind.build(model, profiling=settings.profile)
        sync(device)
        t0 = time.perf_counter()
        token = int(greedy_token(next_token_logits(model, engine.prefill(model, ffn, prompt_ids))))
        sample.prefill_ms.append((time.perf_counter() - t0) * 1000)
        run_whole = []
        timer = StepTimer(device)
        wire_before = ffn.wire_bytes()
        for i in range(settings.warmup + settings.new_tokens):
            if i == settings.warmup:
                wire_before = ffn.wire_bytes()
            timer.start()
            if i >= settings.warmup:
                with recording(sample.decode_kinds):
                    hidden = engine.decode_step(model, ffn, token)
                sample.decode_steps += 1
            else:
                hidden = engine.decode_step(model, ffn, token)
            timer.split()
            picked = greedy_token(next_token_logits(model, hidden))
            timer.end()
            token = int(picked)
            took = timer.stop()
            if i >= settings.warmup:
                sample.fwd.append(took.forward_ms)
                sample.head.append(took.head_ms)
                run_whole.append(took.whole_ms)
        held = peak.held_now()
        if held is not None:
            row.held_bytes = max(row.held_bytes or 0, held)
    sample.whole += run_whole
    if run_whole:
        sample.wire.append((ffn.wire_bytes() - wire_before) / len(run_whole))
    row.tok_s_runs.append(1000 * len(run_whole) / sum(run_whole) if run_whole else 0.0)
    if peak.bytes is not None:
        row.peak_working_bytes = max(row.peak_working_bytes or 0, peak.bytes)
    sample.memory = engine.memory()
    sample.label = engine.info().label
    sample.dispatch = engine.dispatch_path()
    summary = engine.stage_summary()
    sample.stages = None if summary is None else {stage: us for stage, us in summary.rows()}


def _summarise(
    model: Model, prompt_ids: list[int], settings: BenchSettings, row: EngineRow, sample: _Samples
) -> None:
    row.prefill_ms = statistics.median(sample.prefill_ms)
    row.step = StepStats.of(sample.whole)
    row.fwd_ms = sum(sample.fwd) / len(sample.fwd) if sample.fwd else None
    row.head_ms = sum(sample.head) / len(sample.head) if sample.head else None
    row.tok_s = statistics.median(row.tok_s_runs) if sample.whole else None
    row.memory = sample.memory
    row.context_tokens = len(prompt_ids) + settings.warmup + settings.new_tokens
    row.fp16_full_bytes = model.config.kv_bytes_per_token(2) * row.context_tokens
    row.label = sample.label
    row.stages = sample.stages
    row.dispatch = sample.dispatch
    row.decode_path = decode_path(model, sample.decode_kinds, sample.decode_steps)
    row.wire_bytes_per_tok = statistics.median(sample.wire) if sample.wire else 0.0
