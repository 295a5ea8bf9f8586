"""`standard`'s fast path on a GPU: a preallocated (static) K/V cache and the one-token decode
step captured in a CUDA graph (`larql.kv.captured_step`). `StandardEngine` owns one where it
runs, as turbo-quant's engine owns its `KernelPath`.

Each layer's K/V lives in a [Hkv, capacity, D] buffer whose row i is position i; the step writes
its row at a position held in a device tensor (one launch for K and V on CUDA, else
`index_copy_`) and attends through larql's split-key Triton kernel, which reads that position and
skips the rows past it
(`attend_static_kernel`; `attention=sdpa`: torch's attention over the whole buffer with a mask,
`attend_static`). Capacity grows by doubling (a re-capture each time). `compile=1` also fuses the
step's small kernels with torch.compile, tuning their block sizes for these shapes.

It computes exactly what the eager path computes (same primitives; the eager path stays the
reference and the tests compare the two). The graph is used only with an FFN backend
that says it is `graph_safe` (dense, null, a router of those); any other backend (a remote
shard, a sparse walk) runs the same static step eagerly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from larql.inference.ffn import FfnBackend
from larql.inference.layer import (
    attend_static,
    attend_static_kernel,
    attention_output,
    effective_window,
    embed_rows,
    ffn_block,
    kept_rows,
    layer_step,
    project_q_with_rope,
    project_qkv_storing,
    static_mask,
    token_tensor,
)
from larql.inference.memory import MemoryBreakdown, tensor_bytes
from larql.inference.shared_kv import SharedKv, shares
from larql.kernels import DecodeAttention, decode_attention_kernel
from larql.kernels.ran import COMPILED, ran
from larql.kv.buffers import KvBuffer
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


class StaticCache:
    """The static K/V cache of every layer and the decode step over it."""

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
        self._keys: list[torch.Tensor] | None = None  # per layer [Hkv, capacity, D]
        self._capacity = 0  # rows each buffer holds (read every batched step, for every session)
        self._values: list[torch.Tensor] | None = None
        self._inputs: StepInputs | None = None
        self._graph = CapturedStep()
        self._kernel: DecodeAttention | None = None  # resolved at prefill, for the model's device
        self._offsets: tuple[torch.Tensor, list[int]] | None = None  # `buffer_offsets`' answer
        self._model: Model | None = None  # the model whose K/V it holds

    @property
    def capacity(self) -> int:
        return self._capacity

    def describe(self) -> str:
        attention = "triton" if self._kernel is not None else "sdpa"
        return f"static K/V cache, {self.dispatch_path()} decode step, {attention} attention"

    def memory(self) -> MemoryBreakdown:
        held = {t.data_ptr(): t for t in (*(self._keys or []), *(self._values or []))}
        return MemoryBreakdown(hot=tensor_bytes(*held.values()))  # shared buffers counted once

    def dispatch_path(self) -> str:
        return "cuda-graph" if self._graph.captured else "static"

    def start(self, model: Model, ffn: FfnBackend, token_ids: list[int]) -> torch.Tensor:
        """The prompt at positions 0.. → every row's hidden [S, H]; its K/V in the cache."""
        # the decode-attention kernel has no attention sinks
        use_kernel = self.attention != "sdpa" and not model.config.arch.attention_sinks
        self._kernel = decode_attention_kernel(model.device) if use_kernel else None
        self._allocate(model, initial_capacity(len(token_ids)))
        self._model = model
        assert self._keys is not None and self._values is not None
        h, inputs = embed_rows(model, token_tensor(model, token_ids))  # [S, H], …
        shared = SharedKv(model.config)
        for layer in range(model.config.num_layers):
            sink = _PrefillSink(self._keys[layer], self._values[layer])
            h = layer_step(model, layer, h, 0, sink, ffn, self.window, inputs, shared)
        return h

    def step(self, model: Model, ffn: FfnBackend, token_id: int, position: int) -> torch.Tensor:
        """The token at `position` through every layer → hidden [1, H]."""
        self.reserve(model, position)
        assert self._inputs is not None
        self._inputs.set(token_id, position)
        step = self._step_function(model, ffn)
        if self.use_graph and self._graph.ready(model, ffn, step):
            return self._graph.replay()
        return step()

    def reserve(self, model: Model, position: int) -> None:
        """Room for a row at `position` (the buffers double until it fits)."""
        while position >= self.capacity:
            self._allocate(model, self.capacity * 2)

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s key and value buffers, [Hkv, capacity, D] each."""
        assert self._keys is not None and self._values is not None
        return self._keys[layer], self._values[layer]

    def buffer_offsets(self, anchor: torch.Tensor) -> list[int]:
        """Where every layer's key and value buffers start, in elements from `anchor` (same
        dtype and device): [keys 0, values 0, keys 1, …], kept until the buffers move."""
        if self._offsets is None or self._offsets[0] is not anchor:
            assert self._keys is not None and self._values is not None
            base, size = anchor.data_ptr(), anchor.element_size()
            pairs = zip(self._keys, self._values, strict=True)
            offsets = [(t.data_ptr() - base) // size for pair in pairs for t in pair]
            self._offsets = (anchor, offsets)
        return self._offsets[1]

    def held_rows(self, position: int) -> list[KvBuffer]:
        """Every layer's live rows after `position` tokens as the eager path holds them (all,
        or its window's last; none on a K/V-sharing layer) — what its state declares."""
        assert self._model is not None
        return [self._held_rows(self._model, layer, position) for layer in self._layer_range()]

    def _layer_range(self) -> range:
        assert self._model is not None
        return range(self._model.config.num_layers)

    def _held_rows(self, model: Model, layer: int, position: int) -> KvBuffer:
        window = effective_window(model, layer, self.window)
        buffer = KvBuffer(keep=kept_rows(window))
        if not shares(model.config, layer):
            keys, values = self.layer_buffers(layer)  # [Hkv, capacity, D] each
            first = 0 if buffer.keep is None else max(0, position - buffer.keep)
            buffer.append(keys[:, first:position], values[:, first:position])
        return buffer

    def hold(self, model: Model, layers: list[KvBuffer], position: int) -> None:
        """Take back every layer's live rows (`held_rows`' buffers) after `position` tokens:
        row i of a buffer is position i, so each layer's rows go to the positions they end at."""
        use_kernel = self.attention != "sdpa" and not model.config.arch.attention_sinks
        self._kernel = decode_attention_kernel(model.device) if use_kernel else None
        self._allocate(model, initial_capacity(position))
        self._model = model
        assert self._keys is not None and self._values is not None
        for layer, buffer in enumerate(layers):
            if shares(model.config, layer) or len(buffer) == 0:
                continue
            first = position - len(buffer)
            self._keys[layer][:, first:position] = buffer.keys
            self._values[layer][:, first:position] = buffer.values

    def _step_function(self, model: Model, ffn: FfnBackend) -> Callable[[], torch.Tensor]:
        if not self.compile:
            return lambda: self.static_step(model, ffn)
        compiled = _compiled_static_step()

        def step() -> torch.Tensor:
            ran(COMPILED)
            return compiled(self, model, ffn)

        return step

    def static_step(self, model: Model, ffn: FfnBackend) -> torch.Tensor:
        """One token at the position in `self._inputs`, every shape static. → hidden [1, H]."""
        assert self._keys is not None and self._values is not None and self._inputs is not None
        capacity = self.capacity
        kernel = self._kernel
        pos = self._inputs.position
        masks: dict[int | None, torch.Tensor] = {}  # per window: layers share them
        rope = RopeAtPosition(pos)
        h, inputs = embed_rows(model, self._inputs.token)  # [1, H], [1, L, P] or None
        for layer in range(model.config.num_layers):
            window = effective_window(model, layer, self.window)
            if window not in masks and kernel is None:
                masks[window] = static_mask(capacity, pos, window)
            if shares(model.config, layer):  # its buffers are its source's, written already
                q = project_q_with_rope(model, layer, h, *rope(model, layer))
            else:  # q, its K/V row into the cache
                cos, sin = rope(model, layer)
                q = project_qkv_storing(
                    model, layer, h, cos, sin, self._keys[layer], self._values[layer], pos
                )
            kv = self._keys[layer], self._values[layer]  # [Hkv, C, D] each
            if kernel is not None:
                attn = attend_static_kernel(model, q, *kv, pos, window, kernel)
            else:
                sinks = model.weights.layers[layer].attn_sinks
                attn = attend_static(model, q, *kv, masks[window], sinks)
            h = ffn_block(model, layer, attention_output(model, layer, h, attn), ffn, inputs)
        return h

    def _allocate(self, model: Model, capacity: int) -> None:
        cfg = model.config
        shapes = [(cfg.kv_heads_of(i), capacity, cfg.head_dim_of(i)) for i in range(cfg.num_layers)]
        old_k, old_v = self._keys, self._values
        kw = {"dtype": model.dtype, "device": model.device}
        self._keys, self._values = [], []
        for layer, shape in enumerate(shapes):
            source = cfg.kv_source_of(layer)  # a K/V-sharing layer reads its source's buffers
            self._keys.append(torch.zeros(shape, **kw) if source is None else self._keys[source])
            self._values.append(
                torch.zeros(shape, **kw) if source is None else self._values[source]
            )
        if old_k is not None and old_v is not None:
            n = old_k[0].shape[1]
            for new, old in zip(self._keys + self._values, old_k + old_v, strict=True):
                new[:, :n] = old
        self._capacity = capacity
        reserve_rope(model, capacity)
        self._offsets = None
        self._inputs = StepInputs(model.device)
        self._graph.invalidate()


@functools.cache
def _compiled_static_step() -> Callable[..., torch.Tensor]:
    """One compiled step shared by every cache, so a new engine of the same shapes reuses the
    compiled kernels instead of compiling again (torch.compile guards on shapes, not objects)."""

    def step(cache: StaticCache, model: Model, ffn: FfnBackend) -> torch.Tensor:
        return cache.static_step(model, ffn)

    # coordinate descent tunes the block sizes of every generated kernel for these exact
    # shapes (norms, RoPE, the K/V writes): ~25% off the H200 step (docs/PERFORMANCE.md)
    return torch.compile(step, dynamic=False, options={"coordinate_descent_tuning": True})
