"""Programmatic dependent launch for the decode step's kernels (Hopper, compute capability 9.0,
and later).

A decode step on the GPU is a chain of short launches, each of a few microseconds, and a
launch's own start — its programs scheduled once the previous kernel has drained — is a
visible part of each. Launched with this attribute, a kernel may be scheduled while the kernel
before it in the stream is still finishing; `wait_for_previous`, called by each of its programs
before it reads what an earlier launch wrote, holds the program until that kernel has finished
and its writes are visible (`griddepcontrol.wait`), then lets the next such launch be scheduled
in turn (`griddepcontrol.launch_dependents`). So only the launches' latency overlaps (and reads
of constant weights) — no read of a previous kernel's output and no write of a program ever
runs before the previous kernel's last one, and the order of the step is the stream's. A kernel
launched without the attribute (a cuBLAS product) waits for the previous one as always.

Every program must call `wait_for_previous` unconditionally, before it reads anything an earlier
launch may write and before it writes anything: a program that returned without waiting could
let its grid finish before the kernel it follows, and the next launch's wait would then not
cover that kernel. What no launch writes (a model's weights) may be read before the wait, so
that the read overlaps the previous launch's end (`larql.kernels.gemv` does).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_FIRST_CAPABILITY = (9, 0)  # griddepcontrol is PTX for sm_90 and later


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= _FIRST_CAPABILITY


def enabled(device: torch.device) -> bool:
    """Whether launches on `device` use the attribute: a CUDA device of compute capability 9.0
    or later, not under Triton's interpreter (which runs no PTX)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def options(device: torch.device) -> dict[str, bool]:
    """The launch keywords: the kernel's `PDL` constant and Triton's `launch_pdl`."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Called by every program of a kernel launched with `options`, before its first read of
    anything an earlier launch may have written."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
