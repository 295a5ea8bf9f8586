"""`standard`'s static fast path for several sessions in one decode step.

Each session keeps its own `StaticCache` (its buffers, its capacity). A batched step reads the
weights once for all its rows and each row attends over its own session's buffers through
`batched_decode_attention`, which reaches them by offsets from one anchor tensor. The step's
inputs (the rows, and per row its position, capacity and buffer offsets) live in device tensors
filled before each replay, so on CUDA one captured graph per batch-size bucket (1, 2, 4, … 64,
then multiples of 64) and largest capacity serves any set of sessions: rows past the real ones
write into and attend over a one-row pad cache. Where the kernel does not run (no Triton, or
a model with attention sinks, or `attention=sdpa`), the same step runs eagerly, each row's
attention through `attend_static`.

Greedy tokens batched equal the tokens alone; logits agree to float rounding (the splits of the
key range follow the batch's largest capacity, not each session's own).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from larql.inference.ffn import FfnBackend
from larql.inference.host_copy import ints_to_device
from larql.inference.layer import (
    attend_static,
    attention_output,
    batched_layer_step,
    effective_window,
    ffn_block,
    project_q_with_rope,
    project_qkv_with_rope,
    static_mask,
)
from larql.kv.captured_step import (
    CapturedStep,
    RopeAtPosition,
    bucket,
    next_power_of_two,
    reserve_rope,
)
from larql.kv.standard.static import StaticCache
from larql.models.model import Model

_META = 2  # meta rows before the offsets: positions, capacities


@dataclass
class _BucketStep:
    """One bucket's device inputs and its captured graph."""

    rows: torch.Tensor  # [Bb, H] model dtype
    # [2 + 2L, Bb] int64: positions, capacities, then per layer the key and value buffers'
    # offsets from the anchor (in elements)
    meta: torch.Tensor
    per_layer: torch.Tensor | None  # [Bb, L, P]: the rows' per-layer inputs (Gemma 4), or None
    graph: CapturedStep = field(default_factory=CapturedStep)
    # the sessions' buffer offsets (each cache's own list) and capacities `meta` holds now
    layout: list[tuple[list[int], int]] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # the positions `meta` holds now


class BatchedStaticStep:
    """The batched step over `StaticCache`s of one model and window (one per model, window and
    graph setting: `of`)."""

    def __init__(self, model: Model, window: int | None, use_graph: bool, attention: str) -> None:
        from larql.kernels import batched_decode_attention_kernel

        cfg = model.config
        self.window, self.use_graph = window, use_graph
        kw = {"dtype": model.dtype, "device": model.device}
        self.anchor = torch.zeros(1, **kw)  # every offset counts from here
        use_kernel = attention != "sdpa" and not cfg.arch.attention_sinks
        self._kernel = batched_decode_attention_kernel(model.device) if use_kernel else None
        # the rows past the real ones: one-row buffers per layer, written and attended at row 0
        pads = [(cfg.kv_heads_of(i), 1, cfg.head_dim_of(i)) for i in range(cfg.num_layers)]
        self._pad = [torch.zeros(pads[i // 2], **kw) for i in range(2 * cfg.num_layers)]
        self._pad_meta = [0, 1, *(self._offset(t) for t in self._pad)]
        self._buckets: dict[tuple[int, int], _BucketStep] = {}

    @staticmethod
    def of(model: Model, window: int | None, use_graph: bool, attention: str) -> BatchedStaticStep:
        key = ("static-batch", window, use_graph, attention)
        step = model.runtime.get(key)
        if not isinstance(step, BatchedStaticStep):
            step = model.runtime[key] = BatchedStaticStep(model, window, use_graph, attention)
        return step

    def step(
        self,
        model: Model,
        ffn: FfnBackend,
        caches: Sequence[StaticCache],
        positions: Sequence[int],
        rows: torch.Tensor,
        layer_inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        """rows [B, H]: row b is session b's token embedded, at positions[b] (per-layer inputs
        [B, L, P] or None) → hidden [B, H]; each row's K/V into its session's cache."""
        for cache, position in zip(caches, positions, strict=True):
            cache.reserve(model, position)
        if self._kernel is None:
            return self._eager(model, ffn, caches, positions, rows, layer_inputs)
        count = rows.shape[0]
        capacity = next_power_of_two(max(cache.capacity for cache in caches))
        inputs = self._inputs(model, bucket(count), capacity)
        self._fill_meta(inputs, caches, positions)
        inputs.rows[:count].copy_(rows)
        inputs.rows[count:].zero_()
        if inputs.per_layer is not None and layer_inputs is not None:
            inputs.per_layer[:count].copy_(layer_inputs)
            inputs.per_layer[count:].zero_()

        def forward() -> torch.Tensor:
            return self._forward(model, ffn, inputs, capacity)

        if self.use_graph and inputs.graph.ready(model, ffn, forward):
            return inputs.graph.replay()[:count]
        return forward()[:count]

    def _fill_meta(
        self, inputs: _BucketStep, caches: Sequence[StaticCache], positions: Sequence[int]
    ) -> None:
        """The rows' positions, capacities and buffer offsets into `inputs.meta`. The same
        sessions as the bucket's last step, none of whose buffers moved, change only their
        positions: one row copied instead of the whole table (which, built from Python lists,
        cost more host time than the step's launches for 64 sessions), or, where each moved
        one on, one row incremented on the device. No copy waits for the device, so this
        step may be queued while the one before runs."""
        layout = [(cache.buffer_offsets(self.anchor), cache.capacity) for cache in caches]
        same = len(layout) == len(inputs.layout) and all(
            offsets is before and capacity == capacity_before
            for (offsets, capacity), (before, capacity_before) in zip(
                layout, inputs.layout, strict=True
            )
        )
        count = len(caches)
        if same:
            before = inputs.positions
            if all(now == then + 1 for now, then in zip(positions, before, strict=True)):
                inputs.meta[0, :count] += 1
            else:
                inputs.meta[0, :count].copy_(ints_to_device(positions, inputs.meta.device))
            inputs.positions = list(positions)
            return
        meta = [
            [position, capacity, *offsets]
            for (offsets, capacity), position in zip(layout, positions, strict=True)
        ]
        meta += [self._pad_meta] * (inputs.rows.shape[0] - count)
        table = [value for column in zip(*meta, strict=True) for value in column]
        inputs.meta.copy_(ints_to_device(table, inputs.meta.device).view(inputs.meta.shape))
        inputs.layout, inputs.positions = layout, list(positions)

    def _inputs(self, model: Model, size: int, capacity: int) -> _BucketStep:
        key = (size, capacity)
        if key not in self._buckets:
            reserve_rope(model, capacity)
            cfg, device = model.config, model.device
            rows = torch.zeros((size, cfg.hidden_size), dtype=model.dtype, device=device)
            meta = torch.zeros((_META + 2 * cfg.num_layers, size), dtype=torch.long, device=device)
            table = model.weights.per_layer
            per_layer = None
            if table is not None:
                shape = (size, cfg.num_layers, table.norm.shape[0])
                per_layer = torch.zeros(shape, dtype=model.dtype, device=device)
            self._buckets[key] = _BucketStep(rows, meta, per_layer)
        return self._buckets[key]

    def _forward(
        self, model: Model, ffn: FfnBackend, inputs: _BucketStep, capacity: int
    ) -> torch.Tensor:
        """Every layer over the bucket's rows, every shape static. → hidden [Bb, H]"""
        assert self._kernel is not None
        cfg = model.config
        softcap = cfg.arch.attn_softcap or 0.0
        positions, capacities = inputs.meta[0], inputs.meta[1]  # [Bb] each
        rope = RopeAtPosition(positions)
        h = inputs.rows
        new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # each layer's new K/V rows
        for layer in range(cfg.num_layers):
            window = effective_window(model, layer, self.window)
            source = cfg.kv_source_of(layer)
            if source is None:
                q, k, v = project_qkv_with_rope(model, layer, h, *rope(model, layer))
                new[layer] = k, v
            else:  # its buffers are its source's: the kernel writes the source's rows again
                q = project_q_with_rope(model, layer, h, *rope(model, layer))
                k, v = new[source]
            keys, values = inputs.meta[_META + 2 * layer], inputs.meta[_META + 2 * layer + 1]
            attn = self._kernel(
                q,
                k,
                v,
                self.anchor,
                keys,
                values,
                positions,
                capacities,
                capacity,
                cfg.attn_scale,
                window or 0,
                softcap,
            )  # [Bb, q_dim]
            h = attention_output(model, layer, h, attn)
            h = ffn_block(model, layer, h, ffn, inputs.per_layer)
        return h

    def _eager(
        self,
        model: Model,
        ffn: FfnBackend,
        caches: Sequence[StaticCache],
        positions: Sequence[int],
        rows: torch.Tensor,
        layer_inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        """The same step without the kernel: projections and FFN once over the rows, each
        row's attention over its own cache with `attend_static`."""
        steps = [torch.tensor([p], device=model.device) for p in positions]
        h = rows
        for layer in range(model.config.num_layers):
            attend_row = _row_attention(model, layer, caches, steps, self.window)
            h = batched_layer_step(model, layer, h, list(positions), attend_row, ffn, layer_inputs)
        return h

    def _offset(self, buffer: torch.Tensor) -> int:
        return (buffer.data_ptr() - self.anchor.data_ptr()) // buffer.element_size()


def _row_attention(
    model: Model,
    layer: int,
    caches: Sequence[StaticCache],
    positions: Sequence[torch.Tensor],
    engine_window: int | None,
) -> Callable[..., torch.Tensor]:
    window = effective_window(model, layer, engine_window)
    sinks = model.weights.layers[layer].attn_sinks

    def attend_row(
        i: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        keys, values = caches[i].layer_buffers(layer)  # [Hkv, C, D] each (a sharer's: its source's)
        if k is not None and v is not None:
            keys.index_copy_(1, positions[i], k)
            values.index_copy_(1, positions[i], v)
        mask = static_mask(keys.shape[1], positions[i], window)
        return attend_static(model, q, keys, values, mask, sinks)  # [1, q_dim]

    return attend_row
