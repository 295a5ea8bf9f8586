"""`standard` with a preallocated (static) K/V cache and, on CUDA, the one-token decode step
captured in a CUDA graph (`larql.kv.captured_step`): the fast path of `standard` on a GPU.

Each layer's K/V lives in a [Hkv, capacity, D] buffer whose row i is position i; the step writes
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

from larql.inference.engine import EngineInfo, KvEngine, backend_name
from larql.inference.errors import EmptyPrompt, InvariantViolation
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
    static_mask,
    token_tensor,
)
from larql.inference.memory import MemoryBreakdown, tensor_bytes
from larql.kernels import DecodeAttention, decode_attention_kernel
from larql.kv.captured_step import (
    CapturedStep,
    RopeAtPosition,
    StepInputs,
    initial_capacity,
    reserve_rope,
)
from larql.models.model import Model


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
        self._inputs: StepInputs | None = None
        self._graph = CapturedStep()
        self._backend = "cpu"
        self._kernel: DecodeAttention | None = None  # resolved at prefill, for the model's device

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys[0].shape[1]

    def info(self) -> EngineInfo:
        attention = "triton" if self._kernel is not None else "sdpa"
        return EngineInfo(
            name=self.name,
            description=(
                f"static K/V cache, {self.dispatch_path()} decode step, {attention} attention "
                f"({self.memory().brief()})"
            ),
            backend=self._backend,
            config=f"window={self.window}" if self.window else "window=full",
        )

    def memory(self) -> MemoryBreakdown:
        return MemoryBreakdown(hot=tensor_bytes(*(self._keys or []), *(self._values or [])))

    def window_tokens(self) -> int:
        return min(self.position, self.window) if self.window else self.position

    def dispatch_path(self) -> str | None:
        return "cuda-graph" if self._graph.captured else "static"

    def prefill(self, model: Model, ffn: FfnBackend, token_ids: Sequence[int]) -> torch.Tensor:
        if len(token_ids) == 0:
            raise EmptyPrompt()
        self._backend = backend_name(model)
        use_kernel = self.attention != "sdpa"
        self._kernel = decode_attention_kernel(model.device) if use_kernel else None
        n = len(token_ids)
        self._allocate(model, initial_capacity(n))
        assert self._keys is not None and self._values is not None
        h = embed(model, token_tensor(model, token_ids))  # [S, H]
        for layer in range(model.config.num_layers):
            sink = _PrefillSink(self._keys[layer], self._values[layer])
            h = layer_step(model, layer, h, 0, sink, ffn, self.window)
        self.position = n
        return h[-1:]

    def decode_step(self, model: Model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        if self._keys is None or self._inputs is None:
            raise InvariantViolation("decode_step called before prefill")
        if self.position >= self.capacity:
            self._allocate(model, self.capacity * 2)
        self._inputs.set(token_id, self.position)
        step = self._step_function(model, ffn)
        if self.use_graph and self._graph.ready(model, ffn, step):
            hidden = self._graph.replay()
        else:
            hidden = step()
        self.position += 1
        return hidden

    def _step_function(self, model: Model, ffn: FfnBackend) -> Callable[[], torch.Tensor]:
        if not self.compile:
            return lambda: self._step(model, ffn)
        compiled = _compiled_static_step()
        return lambda: compiled(self, model, ffn)

    def _step(self, model: Model, ffn: FfnBackend) -> torch.Tensor:
        """One token at the position in `self._inputs`, every shape static. → hidden [1, H]."""
        assert self._keys is not None and self._values is not None and self._inputs is not None
        capacity = self.capacity
        kernel = self._kernel
        pos = self._inputs.position
        masks: dict[int | None, torch.Tensor] = {}  # per window: layers share them
        rope = RopeAtPosition(pos)
        h = embed(model, self._inputs.token)  # [1, H]
        for layer in range(model.config.num_layers):
            window = effective_window(model, layer, self.window)
            if window not in masks and kernel is None:
                masks[window] = static_mask(capacity, pos, window)
            q, k, v = project_qkv_rotated(model, layer, h, *rope(model, layer))
            self._keys[layer].index_copy_(1, pos, k)
            self._values[layer].index_copy_(1, pos, v)
            kv = self._keys[layer], self._values[layer]  # [Hkv, C, D] each
            if kernel is not None:
                attn = attend_static_kernel(model, layer, q, *kv, pos, window, kernel)
            else:
                attn = attend_static(model, layer, q, *kv, masks[window])
            h = ffn_block(model, layer, attention_output(model, layer, h, attn), ffn)
        return h

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
        reserve_rope(model, capacity)
        self._inputs = StepInputs(model.device)
        self._graph.invalidate()


@functools.cache
def _compiled_static_step() -> Callable[..., torch.Tensor]:
    """One compiled step shared by every engine, so a new engine of the same shapes reuses the
    compiled kernels instead of compiling again (torch.compile guards on shapes, not objects)."""

    def step(engine: StaticCacheEngine, model: Model, ffn: FfnBackend) -> torch.Tensor:
        return engine._step(model, ffn)

    # coordinate descent tunes the block sizes of every generated kernel for these exact
    # shapes (norms, RoPE, the K/V writes): ~25% off the H200 step (docs/PERFORMANCE.md)
    return torch.compile(step, dynamic=False, options={"coordinate_descent_tuning": True})
