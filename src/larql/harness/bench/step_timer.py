"""Timing one decode step the way the generation loop runs it, split at the engine's output.

The whole token is host time from the engine call to the picked token in hand, with nothing
synchronised in between: on CUDA the host queues the head (final norm, LM head, argmax) while
the GPU still runs the step, as `GenerationSession.step` does. The split into forward and head
comes from the host clock on the CPU (every op is synchronous there) and from CUDA events on the
stream on a GPU, so measuring it does not add the drain a mid-step sync would."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepTime:
    whole_ms: float
    forward_ms: float
    head_ms: float


class StepTimer:
    """start() → the engine step → split() → the head, queued → end() → the token read (the
    read synchronises) → stop()."""

    def __init__(self, device: torch.device) -> None:
        self._events = (
            tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
            if device.type == "cuda"
            else None
        )
        self._marks = [0.0, 0.0, 0.0]

    def start(self) -> None:
        self._marks[0] = time.perf_counter()
        if self._events is not None:
            self._events[0].record()

    def split(self) -> None:
        self._marks[1] = time.perf_counter()
        if self._events is not None:
            self._events[1].record()

    def end(self) -> None:
        """Mark the end of the queued head, before the token is read back."""
        if self._events is not None:
            self._events[2].record()

    def stop(self) -> StepTime:
        """Call once the picked token is on the host."""
        now = time.perf_counter()
        whole = (now - self._marks[0]) * 1000
        if self._events is None:
            forward = (self._marks[1] - self._marks[0]) * 1000
            return StepTime(whole, forward, whole - forward)
        begin, middle, finish = self._events
        finish.synchronize()
        return StepTime(whole, begin.elapsed_time(middle), middle.elapsed_time(finish))
