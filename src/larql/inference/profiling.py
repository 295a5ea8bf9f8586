"""Per-stage decode timings: an `EngineProfiler` engines feed while decoding,
and the `DecodeStageSummary` it produces. Profiling only reads clocks; outputs are unchanged."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

STAGES = (
    "embed",
    "recompute_cold",
    "recompute_hot",
    "attention",
    "ffn",
    "decode_total",
    "state_capture",
    "state_materialise",
    "state_append",
)


@dataclass
class StageAccumulator:
    total_us: float = 0.0
    count: int = 0

    def add(self, us: float) -> None:
        self.total_us += us
        self.count += 1

    def avg_us(self) -> float:
        return self.total_us / self.count if self.count else 0.0


@dataclass(frozen=True)
class DecodeStageSummary:
    engine: str
    backend: str
    steps: int
    avg_embed_us: float
    avg_recompute_cold_us: float
    avg_recompute_hot_us: float
    avg_attention_us: float
    avg_ffn_us: float
    avg_total_decode_us: float
    avg_state_capture_us: float
    avg_state_materialise_us: float
    avg_state_append_us: float

    def avg_recompute_total_us(self) -> float:
        return self.avg_recompute_cold_us + self.avg_recompute_hot_us

    def rows(self) -> list[tuple[str, float]]:
        """(stage, µs per decode step) in print order; empty groups are left out."""
        rows = [("embed", self.avg_embed_us)]
        if self.avg_recompute_total_us() > 0:
            rows += [
                ("recompute_kv (cold)", self.avg_recompute_cold_us),
                ("recompute_kv (hot)", self.avg_recompute_hot_us),
            ]
        rows += [("attention", self.avg_attention_us), ("ffn", self.avg_ffn_us)]
        state = (self.avg_state_capture_us, self.avg_state_materialise_us, self.avg_state_append_us)
        if sum(state) > 0:
            rows += [
                ("state_capture", state[0]),
                ("state_materialise", state[1]),
                ("state_append", state[2]),
            ]
        return [*rows, ("total (measured)", self.avg_total_decode_us)]

    def format(self) -> str:
        total = self.avg_total_decode_us
        lines = [
            f"Stage breakdown  ({self.engine}, {self.backend}, {self.steps} decode steps avg):"
        ]
        for stage, us in self.rows():
            share = 100.0 * us / total if total > 0 else 0.0
            lines.append(f"  {stage:<22} {us:>10.1f} µs  {share:>5.1f}%")
        return "\n".join(lines)

    def print(self) -> None:
        print(self.format())


@dataclass
class EngineProfiler:
    """Accumulates wall time per stage while `enabled`; a no-op otherwise."""

    enabled: bool = False
    stages: dict[str, StageAccumulator] = field(
        default_factory=lambda: {s: StageAccumulator() for s in STAGES}
    )

    def stage(self, name: str, device: torch.device | None = None) -> AbstractContextManager[None]:
        if not self.enabled:
            return nullcontext()
        return self._timed(name, device)

    @contextmanager
    def _timed(self, name: str, device: torch.device | None) -> Iterator[None]:
        _sync(device)
        t0 = time.perf_counter()
        yield
        _sync(device)
        self.stages[name].add((time.perf_counter() - t0) * 1e6)

    def summary(self, engine: str, backend: str) -> DecodeStageSummary | None:
        steps = self.stages["decode_total"].count
        if not self.enabled or steps == 0:
            return None
        avg = {s: acc.total_us / steps for s, acc in self.stages.items()}
        return DecodeStageSummary(
            engine=engine,
            backend=backend,
            steps=steps,
            avg_embed_us=avg["embed"],
            avg_recompute_cold_us=avg["recompute_cold"],
            avg_recompute_hot_us=avg["recompute_hot"],
            avg_attention_us=avg["attention"],
            avg_ffn_us=avg["ffn"],
            avg_total_decode_us=avg["decode_total"],
            avg_state_capture_us=avg["state_capture"],
            avg_state_materialise_us=avg["state_materialise"],
            avg_state_append_us=avg["state_append"],
        )


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
