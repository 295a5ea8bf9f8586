"""A one-token decode step with static shapes, captured once in a CUDA graph and replayed: what
`standard`'s static cache and turbo-quant's kernel path share.

A small model's decode step on a GPU is bound by kernel launches, not by the GPU: replaying a
captured graph launches every layer's kernels with one call. Capture needs every shape and
address fixed, so the step reads the token and its position from device tensors (`StepInputs`)
and writes its state into preallocated buffers; the engine re-captures when it reallocates them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from larql.inference.ffn import FfnBackend
from larql.inference.layer import rope_table
from larql.kernels.ran import CUDA_GRAPH, ran
from larql.models.model import Model

MIN_CAPACITY = 256
DECODE_HEADROOM = 128  # rows reserved past the prompt before the first growth


def initial_capacity(prompt_length: int) -> int:
    """Rows a static buffer is first allocated with: a power of two with room to decode into."""
    return next_power_of_two(max(MIN_CAPACITY, prompt_length + DECODE_HEADROOM))


def next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


# batch sizes a batched step's graph is captured for (then multiples of the last): any set of
# sessions runs in the smallest that holds it, rows past the real ones padding
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(rows: int) -> int:
    """The captured batch size that holds `rows` rows."""
    for size in BUCKETS:
        if rows <= size:
            return size
    return -(-rows // BUCKETS[-1]) * BUCKETS[-1]


class StepInputs:
    """The step's inputs as device tensors (a captured graph reads them at replay)."""

    def __init__(self, device: torch.device) -> None:
        self.token = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # [1]

    def set(self, token_id: int, position: int) -> None:
        self.token.fill_(token_id)
        self.position.fill_(position)


class RopeAtPosition:
    """Each layer's RoPE cos/sin at the step's position, gathered on the device once per table
    (layers of the same RoPE share it). Make one per step."""

    def __init__(self, position: torch.Tensor) -> None:
        self._position = position  # [1] long
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, model: Model, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """→ cos, sin: [1, rotary_dim]"""
        table = rope_table(model, layer)
        if id(table) not in self._rows:
            self._rows[id(table)] = (
                table.cos.index_select(0, self._position),
                table.sin.index_select(0, self._position),
            )
        return self._rows[id(table)]


def reserve_rope(model: Model, capacity: int) -> None:
    """Size every layer's RoPE table for `capacity` positions before a capture (a table that
    grew later would be a new tensor the graph does not read)."""
    for layer in range(model.config.num_layers):
        rope_table(model, layer).slice(0, capacity)


class CapturedStep:
    """The step `step() → hidden [1, H]` captured in a CUDA graph, once per FFN backend and per
    allocation of the engine's buffers (`invalidate` after reallocating them)."""

    def __init__(self) -> None:
        self._graph: torch.cuda.CUDAGraph | None = None
        self._ffn: FfnBackend | None = None
        self._out: torch.Tensor | None = None  # [1, H], the graph's output
        self._tables: list[torch.Tensor] = []  # kept alive: the graph reads them

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def invalidate(self) -> None:
        self._graph, self._ffn, self._out, self._tables = None, None, None, []

    def ready(
        self,
        model: Model,
        ffn: FfnBackend,
        step: Callable[[], torch.Tensor],
        preserve: Sequence[torch.Tensor] = (),
    ) -> bool:
        """Capture `step` for this backend unless it is; False where it cannot be captured
        (not CUDA, or an FFN backend that does not say it is `graph_safe`: a remote shard, a
        sparse walk; a tensor-parallel rank, whose all-reduces stay outside graphs until
        they are measured captured on GPUs). Capturing runs the step once first (a warm-up,
        outside the capture): `preserve` are the state tensors that run must leave as they
        were (a ring buffer whose new row overwrites one the step reads); state the replay
        rewrites identically (a row at the position) needs nothing."""
        if not (model.device.type == "cuda" and ffn.graph_safe and model.shard is None):
            return False
        if self._graph is not None and self._ffn is ffn:
            return True
        saved = [t.clone() for t in preserve]
        side = torch.cuda.Stream(device=model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):
            step()  # warm-up: compiles (if asked) and autotunes outside the capture
        torch.cuda.current_stream(model.device).wait_stream(side)
        for tensor, before in zip(preserve, saved, strict=True):
            tensor.copy_(before)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._out = step()
        self._graph, self._ffn = graph, ffn
        tables = (rope_table(model, layer) for layer in range(model.config.num_layers))
        self._tables = [t for table in tables for t in (table.cos, table.sin)]
        return True

    def replay(self) -> torch.Tensor:
        """→ the step's hidden [1, H] (a copy: the next replay overwrites the output)."""
        assert self._graph is not None and self._out is not None
        ran(CUDA_GRAPH)
        self._graph.replay()
        return self._out.clone()
