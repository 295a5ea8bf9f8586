"""Which kernels a decode step ran: each place that takes a kernel path notes it (`ran`), and a
caller that wants to know records the steps it runs (`recording`). Outside a recording `ran`
costs one thread-local read; inside, one set insertion (it is called once a layer).

The kinds, from the most to the least encompassing: a replayed CUDA graph, a torch.compile'd
step, the CPU extension's whole-step call (every layer in one C++ call), its fused layer pieces,
its block products, the Triton kernels. A step that noted none ran torch's eager operators."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

CUDA_GRAPH = "CUDA graph"
COMPILED = "torch.compile"
FUSED_LAYERS = "fused C++ layers"
FUSED_PIECES = "fused C++ kernels"
BLOCK_PRODUCTS = "C++ block products"
TRITON = "Triton kernels"
EAGER = "eager torch"
KINDS = (CUDA_GRAPH, COMPILED, FUSED_LAYERS, FUSED_PIECES, BLOCK_PRODUCTS, TRITON)

_local = threading.local()


def ran(kind: str) -> None:
    """The kernel path `kind` (one of KINDS) ran in this thread's current step."""
    seen: set[str] | None = getattr(_local, "seen", None)
    if seen is not None:
        seen.add(kind)


@contextmanager
def recording(into: set[str]) -> Iterator[set[str]]:
    """Adds to `into` every kind noted in this thread inside the block (nested recordings each
    see their own block's kinds, and the outer one sees them too)."""
    outer: set[str] | None = getattr(_local, "seen", None)
    _local.seen = inner = set()
    try:
        yield inner
    finally:
        _local.seen = outer
        into |= inner
        if outer is not None:
            outer |= inner


def step_kinds(seen: set[str]) -> str:
    """The kinds in `seen`, most encompassing first, joined with " + " ("eager torch": none)."""
    named = [kind for kind in KINDS if kind in seen]
    return " + ".join(named) if named else EAGER
