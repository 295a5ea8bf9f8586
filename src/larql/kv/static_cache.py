"""`standard` with a preallocated (static) K/V cache and, on CUDA, the one-token decode step
captured in a CUDA graph: the fast path of `standard` on a GPU.

A small model's decode step on a GPU is bound by kernel launches, not by the GPU: replaying a
captured graph launches the ~30 layers' kernels with one call. Capture needs static shapes, so
each layer's K/V lives in a [Hkv, capacity, D] buffer whose row i is position i; the step writes
its row with `index_copy_` at a position held in a device tensor and attends through larql's
split-key Triton kernel, which reads that position and skips the rows past it
(`attend_static_kernel`; `attention=sdpa`: torch's attention over the whole buffer with a mask,
`attend_static`). Capacity grows by doubling (a re-capture each time). `compile=1` also fuses the
step's small kernels with torch.compile, tuning their block sizes for these shapes.

It computes exactly what `StandardEngine` computes (same primitives; the eager `StandardEngine`
stays the reference and the tests compare the two). The graph is used only with an FFN backend
that says it is `graph_safe` (dense, null, a router of those); any other backend (a remote
shard, a sparse walk) runs the same static step eagerly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from larql.inference.engine import (
    EmptyPrompt,
    EngineInfo,
    InvariantViolation,
    KvEngine,
    MemoryBreakdown,
    backend_name,
    mib,
    tensor_bytes,
)
from larql.inference.ffn import FfnBackend
from larql.inference.layer import (
    attend_static,
    attend_static_kernel,
    attention_output,
    effective_window,
    embed,
    ffn_block,
    layer_step,
    project_qkv_rotated,
    rope_table,
    static_mask,
    token_tensor,
)
from larql.kernels import DecodeAttention, decode_attention_kernel
from larql.models.model import Model

_MIN_CAPACITY = 256
_DECODE_HEADROOM = 128  # rows reserved past the prompt before the first growth


class _PrefillSink:
    """Writes a layer's prompt K/V into rows 0..S-1 of the static buffers."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = k.shape[1]
        self.keys[:, :s] = k
        self.values[:, :s] = v
        return self.keys[:, :s], self.values[:, :s]


class StaticCacheEngine(KvEngine):
    name = "standard"

    def __init__(
        self,
        window: int | None = None,
        use_graph: bool = True,
        compile: bool = False,
        attention: str = "auto",
    ) -> None:
        self.window = window
        self.use_graph = use_graph
        self.compile = compile  # fuse the step's small kernels with torch.compile (slow start)
        # "auto"/"triton": larql's decode kernel where Triton runs (else SDPA); "sdpa"
        self.attention = attention
        self.position = 0
        self._keys: list[torch.Tensor] | None = None  # per layer [Hkv, capacity, D]
        self._values: list[torch.Tensor] | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_ffn: FfnBackend | None = None
        self._token: torch.Tensor | None = None  # [1] long, graph input
        self._pos: torch.Tensor | None = None  # [1] long, graph input
        self._out: torch.Tensor | None = None  # [1, H], graph output
        self._captured_tables: list[torch.Tensor] = []  # kept alive: the graph reads them
        self._backend = "cpu"
        self._kernel: DecodeAttention | None = None  # resolved at prefill, for the model's device

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys[0].shape[1]

    def info(self) -> EngineInfo:
        path = "cuda-graph" if self._graph is not None else "static"
        attention = "triton" if self._kernel is not None else "sdpa"
        return EngineInfo(
            name=self.name,
            description=(
                f"static K/V cache, {path} decode step, {attention} attention "
                f"(mem={mib(self.memory_bytes())})"
            ),
            backend=self._backend,
            config=f"window={self.window}" if self.window else "window=full",
        )

    def memory(self) -> MemoryBreakdown:
        return MemoryBreakdown(hot=tensor_bytes(*(self._keys or []), *(self._values or [])))

    def window_tokens(self) -> int:
        return min(self.position, self.window) if self.window else self.position

    def dispatch_path(self) -> str | None:
        return "cuda-graph" if self._graph is not None else "static"

    def prefill(self, model: Model, ffn: FfnBackend, token_ids: Sequence[int]) -> torch.Tensor:
        if len(token_ids) == 0:
            raise EmptyPrompt()
        self._backend = backend_name(model)
        use_kernel = self.attention != "sdpa"
        self._kernel = decode_attention_kernel(model.device) if use_kernel else None
        n = len(token_ids)
        self._allocate(model, _next_power_of_two(max(_MIN_CAPACITY, n + _DECODE_HEADROOM)))
        assert self._keys is not None and self._values is not None
        h = embed(model, token_tensor(model, token_ids))  # [S, H]
        for layer in range(model.config.num_layers):
            sink = _PrefillSink(self._keys[layer], self._values[layer])
            h = layer_step(model, layer, h, 0, sink, ffn, self.window)
        self.position = n
        return h[-1:]

    def decode_step(self, model: Model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        if self._keys is None:
            raise InvariantViolation("decode_step called before prefill")
        if self.position >= self.capacity:
            self._allocate(model, self.capacity * 2)
        assert self._token is not None and self._pos is not None
        self._token.fill_(token_id)
        self._pos.fill_(self.position)
        if self._graph_ready(model, ffn):
            assert self._graph is not None and self._out is not None
            self._graph.replay()
            hidden = self._out.clone()
        else:
            hidden = self._step_function()(model, ffn)
        self.position += 1
        return hidden

    def _step_function(self) -> Callable[[Model, FfnBackend], torch.Tensor]:
        if not self.compile:
            return self._step
        compiled = _compiled_static_step()
        return lambda model, ffn: compiled(self, model, ffn)

    def _step(self, model: Model, ffn: FfnBackend) -> torch.Tensor:
        """One token at the position in `self._pos`, every shape static. → hidden [1, H]."""
        assert self._keys is not None and self._values is not None and self._pos is not None
        capacity = self.capacity
        kernel = self._kernel
        masks: dict[int | None, torch.Tensor] = {}  # per window: layers share them
        rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per RoPE table
        h = embed(model, self._token)  # [1, H]
        for layer in range(model.config.num_layers):
            window = effective_window(model, layer, self.window)
            if window not in masks and kernel is None:
                masks[window] = static_mask(capacity, self._pos, window)
            table = rope_table(model, layer)
            if id(table) not in rotations:
                rotations[id(table)] = (
                    table.cos.index_select(0, self._pos),  # [1, rotary_dim]
                    table.sin.index_select(0, self._pos),
                )
            q, k, v = project_qkv_rotated(model, layer, h, *rotations[id(table)])
            self._keys[layer].index_copy_(1, self._pos, k)
            self._values[layer].index_copy_(1, self._pos, v)
            kv = self._keys[layer], self._values[layer]  # [Hkv, C, D] each
            if kernel is not None:
                attn = attend_static_kernel(model, layer, q, *kv, self._pos, window, kernel)
            else:
                attn = attend_static(model, layer, q, *kv, masks[window])
            h = ffn_block(model, layer, attention_output(model, layer, h, attn), ffn)
        return h

    def _graph_ready(self, model: Model, ffn: FfnBackend) -> bool:
        """Capture the step once per capacity (and FFN backend); False = run it eagerly."""
        capturable = getattr(ffn, "graph_safe", False)
        if not (self.use_graph and model.device.type == "cuda" and capturable):
            return False
        if self._graph is not None and self._graph_ffn is ffn:
            return True
        side = torch.cuda.Stream(device=model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        step = self._step_function()
        with torch.cuda.stream(side):
            step(model, ffn)  # warm-up (compiles, if asked); writes the row the replay rewrites
        torch.cuda.current_stream(model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._out = step(model, ffn)
        self._graph, self._graph_ffn = graph, ffn
        # A RoPE table that grows later is a new tensor; the graph keeps reading these.
        tables = (rope_table(model, layer) for layer in range(model.config.num_layers))
        self._captured_tables = [t for table in tables for t in (table.cos, table.sin)]
        return True

    def _allocate(self, model: Model, capacity: int) -> None:
        cfg = model.config
        shape = (cfg.num_kv_heads, capacity, cfg.head_dim)
        old_k, old_v = self._keys, self._values
        kw = {"dtype": model.dtype, "device": model.device}
        self._keys = [torch.zeros(shape, **kw) for _ in range(cfg.num_layers)]
        self._values = [torch.zeros(shape, **kw) for _ in range(cfg.num_layers)]
        if old_k is not None and old_v is not None:
            n = old_k[0].shape[1]
            for new, old in zip(self._keys + self._values, old_k + old_v, strict=True):
                new[:, :n] = old
        for layer in range(cfg.num_layers):
            rope_table(model, layer).slice(0, capacity)  # tables sized before any capture
        self._token = torch.zeros(1, dtype=torch.long, device=model.device)
        self._pos = torch.zeros(1, dtype=torch.long, device=model.device)
        self._graph, self._graph_ffn, self._out = None, None, None


@functools.cache
def _compiled_static_step() -> Callable[..., torch.Tensor]:
    """One compiled step shared by every engine, so a new engine of the same shapes reuses the
    compiled kernels instead of compiling again (torch.compile guards on shapes, not objects)."""

    def step(engine: StaticCacheEngine, model: Model, ffn: FfnBackend) -> torch.Tensor:
        return engine._step(model, ffn)

    # coordinate descent tunes the block sizes of every generated kernel for these exact
    # shapes (norms, RoPE, the K/V writes): ~25% off the H200 step (docs/PERFORMANCE.md)
    return torch.compile(step, dynamic=False, options={"coordinate_descent_tuning": True})


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()
