"""Facts about the machine a benchmark ran on: measured copy bandwidth, git commit, versions."""

from __future__ import annotations

import functools
import hashlib
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

_COPY_BYTES = 256 * 1024 * 1024


@functools.cache
def copy_bandwidth_gbs(device: str = "cpu", nbytes: int = _COPY_BYTES, repeats: int = 5) -> float:
    """Best-of-`repeats` bandwidth of one large tensor copy, counting bytes read + written."""
    dev = torch.device(device)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    best = math_inf = float("inf")
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 0.0 if best == math_inf else 2 * nbytes / best / 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class PeakAbove:
    """CUDA: the allocator's peak during a block above what was allocated when it began, so
    resident weights, other models and engines kept by the caller are not counted. None off
    CUDA (the CPU allocator keeps no peak)."""

    bytes: int | None = None
    resident: int = 0
    device: torch.device | None = None

    def held_now(self) -> int | None:
        """CUDA: what is allocated now above what was resident when the block began (an
        engine's live state and whatever it keeps beside it; freed temporaries not counted)."""
        if self.device is None or self.device.type != "cuda":
            return None
        sync(self.device)
        return torch.cuda.memory_allocated(self.device) - self.resident


@contextmanager
def peak_above_resident(device: torch.device) -> Iterator[PeakAbove]:
    measured = PeakAbove()
    if device.type != "cuda":
        yield measured
        return
    sync(device)
    measured.device = device
    measured.resident = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield measured
    sync(device)
    measured.bytes = torch.cuda.max_memory_allocated(device) - measured.resident


def git_commit() -> str | None:
    root = Path(__file__).resolve().parents[4]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def ids_hash(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]
