"""turbo-quant's kernel path for several sessions in one decode step.

Each session keeps its own `KernelPath` state (its stores, exact rows and means, allocated at its
own capacity). A batched step reads the weights once for all its rows, and each layer's two
launches (`kernels.batched_attention`) run every session's attention and encoding at once: a
program per (K/V head, split, session), each finding its session's state by offsets from one
anchor tensor. The step's inputs (the rows, each row's position and, per layer, its offsets and
store size) live in device tensors filled before each replay, so on CUDA one captured graph
per batch-size bucket (`captured_step.bucket`) and largest capacity serves any set of sessions:
rows past the real ones attend over and write into a one-slot pad state at position 0. Sessions
whose layers hold fewer rows than their position (an eviction composed with the codec:
`KernelPath.shifted`) step in buckets of their own, whose step lays each layer out by the row's
rows (its position less the layer's offset) and rotates by the position.

Greedy tokens batched equal the tokens alone; logits agree to float rounding (the splits of the
stored rows follow the batch's largest store, not each session's own).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from larql.inference.ffn import FfnBackend
from larql.inference.host_copy import ints_to_device, tensor_to_device
from larql.inference.layer import attention_output, ffn_block, project_qkv_with_rope
from larql.inference.profiling import EngineProfiler
from larql.kv.captured_step import (
    CapturedStep,
    RopeAtPosition,
    bucket,
    next_power_of_two,
    reserve_rope,
)
from larql.kv.turbo_quant.kernel_path import KernelPath
from larql.kv.turbo_quant.store import exact_dtype
from larql.models.model import Model

_ANCHOR_BYTES = 16  # every offset counts from here (16-byte aligned, as stores start)


@dataclass
class _BucketStep:
    """One bucket's device inputs, workspace and captured graph."""

    rows: torch.Tensor  # [Bb, H] model dtype
    positions: torch.Tensor  # [Bb] int64
    meta: torch.Tensor  # [L, Bb, META] int64: per layer, each row's offsets and store slots
    workspace: object  # kernels.Workspace for Bb sessions
    graph: CapturedStep = field(default_factory=CapturedStep)
    # shifted buckets: [L, Bb] int64, each layer's rows not kept of each row's prompt (`offsets`),
    # and the rows each layer holds before the row's new one (`rows_at`, computed in the step)
    offsets: torch.Tensor | None = None
    rows_at: torch.Tensor | None = None
    # the host rows `meta` was last filled from (each session's `batch_meta`), so an unchanged
    # set of sessions is not copied again
    meta_from: list[torch.Tensor] = field(default_factory=list)


class BatchedKernelStep:
    """The batched step over the `KernelPath`s of one model and engine configuration (one per
    model and configuration: `of`)."""

    def __init__(self, model: Model, template: KernelPath) -> None:
        self._kernels = template._kernels
        self.use_graph = template.use_graph
        self.anchor = torch.zeros(_ANCHOR_BYTES, dtype=torch.uint8, device=model.device)
        self.operands = self._kernels.Operands.anchored(self.anchor, exact_dtype(model.dtype))
        # the rows past the real ones: a state of one slot per layer, always at position 0
        self.use_cuda_partial = template.partial_in_cuda
        self._pad = KernelPath(
            self._kernels,
            template.kv_layout,
            model,
            template.keeps,
            False,
            EngineProfiler(False),
            self.use_cuda_partial,
        )
        self._pad.start(model, 0)
        self._pad_meta = self._pad.batch_meta(self.operands)  # [L, META]
        self._buckets: dict[tuple[int, int], _BucketStep] = {}

    @staticmethod
    def of(model: Model, key: Hashable, template: KernelPath) -> BatchedKernelStep:
        """The step for engines of batch key `key` (its first engine's path a template)."""
        step = model.runtime.get(("turbo-quant-batch", key))
        if not isinstance(step, BatchedKernelStep):
            step = BatchedKernelStep(model, template)
            model.runtime[("turbo-quant-batch", key)] = step
        return step

    def step(
        self,
        model: Model,
        ffn: FfnBackend,
        paths: Sequence[KernelPath],
        positions: Sequence[int],
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """rows [B, H]: row b is session b's token embedded, at positions[b] → hidden [B, H];
        each row's K/V into its session's state."""
        for path, position in zip(paths, positions, strict=True):
            path.ensure_room(model, position)
        count = rows.shape[0]
        capacity = next_power_of_two(max(path.capacity for path in paths))
        shifted = any(path.shifted for path in paths)
        # RoPE's rows for every position: beyond the capacity where a layer holds fewer rows
        rope = next_power_of_two(max(capacity, max(positions) + 1)) if shifted else capacity
        inputs = self._inputs(model, bucket(count), capacity, rope, shifted)
        size = inputs.rows.shape[0]
        # Every copy below is queued without waiting for the device (a plain copy from the
        # host waits for all queued work): a step may be queued before the one before is read.
        device = inputs.meta.device
        metas = [path.batch_meta(self.operands) for path in paths]
        metas += [self._pad_meta] * (size - count)
        if len(metas) != len(inputs.meta_from) or any(
            now is not then for now, then in zip(metas, inputs.meta_from, strict=True)
        ):
            inputs.meta.copy_(tensor_to_device(torch.stack(metas, dim=1), device))  # [L, Bb, META]
            inputs.meta_from = metas
        inputs.positions.copy_(ints_to_device([*positions, *[0] * (size - count)], device))
        if inputs.offsets is not None:
            offsets = [path.offsets for path in paths]
            offsets += [[0] * model.config.num_layers] * (size - count)
            offsets_host = torch.tensor(offsets, dtype=torch.long).T.contiguous()  # [L, Bb]
            inputs.offsets.copy_(tensor_to_device(offsets_host, device))
        inputs.rows[:count].copy_(rows)
        inputs.rows[count:].zero_()

        def forward() -> torch.Tensor:
            return self._forward(model, ffn, inputs, capacity)

        if self.use_graph and inputs.graph.ready(model, ffn, forward):
            out = inputs.graph.replay()[:count]
        else:
            out = forward()[:count]
        for path, position in zip(paths, positions, strict=True):
            path.position = position + 1
        return out

    def _inputs(
        self, model: Model, size: int, capacity: int, rope: int, shifted: bool
    ) -> _BucketStep:
        key = (size, capacity, rope, shifted)
        if key not in self._buckets:
            reserve_rope(model, rope)
            cfg, device = model.config, model.device
            long = {"dtype": torch.long, "device": device}
            per_layer = (cfg.num_layers, size)
            self._buckets[key] = _BucketStep(
                rows=torch.zeros((size, cfg.hidden_size), dtype=model.dtype, device=device),
                positions=torch.zeros(size, **long),
                meta=torch.zeros((*per_layer, self._kernels.META.value), **long),
                workspace=self._kernels.Workspace.of(
                    cfg.num_heads, cfg.num_kv_heads, self._pad.tables, device, size
                ),
                offsets=torch.zeros(per_layer, **long) if shifted else None,
                rows_at=torch.zeros(per_layer, **long) if shifted else None,
            )
        return self._buckets[key]

    def _forward(
        self, model: Model, ffn: FfnBackend, inputs: _BucketStep, capacity: int
    ) -> torch.Tensor:
        """Every layer over the bucket's rows, every shape static. → hidden [Bb, H]"""
        cfg = model.config
        softcap = cfg.arch.attn_softcap or 0.0
        rope = RopeAtPosition(inputs.positions)
        rows_at = inputs.rows_at
        if rows_at is not None and inputs.offsets is not None:  # [L, Bb]
            torch.sub(inputs.positions[None, :], inputs.offsets, out=rows_at)
        h = inputs.rows
        for layer in range(cfg.num_layers):
            q, k, v = project_qkv_with_rope(model, layer, h, *rope(model, layer))  # [H·, Bb, D]
            store = self._pad.layers[layer]
            slots = capacity if store.keep is None else min(store.keep, capacity)
            attn = self._kernels.batched_attention(
                q.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                self.operands,
                inputs.meta[layer],
                inputs.positions if rows_at is None else rows_at[layer],
                slots,
                self._pad.tables,
                cfg.attn_scale,
                softcap,
                inputs.workspace,
                self._pad.levers[layer],
                use_cuda_partial=self.use_cuda_partial,
            )  # [Bb, Hq, D]; every session's state now holds its new row
            h = attention_output(model, layer, h, attn.reshape(h.shape[0], cfg.q_dim))
            h = ffn_block(model, layer, h, ffn)
        return h
