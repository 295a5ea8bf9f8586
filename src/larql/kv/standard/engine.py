"""`standard`: the full K/V cache, optionally a sliding window — the reference every other engine
is measured against.

`window=N` is sliding-window attention over N keys including the current token, on every layer,
in prefill (band mask) and decode alike; on an architecture's own sliding layer the smaller
window wins. Each layer keeps only the rows a future query can still see. (The other engines'
"window" means other things: markov-rs's only splits storage, windowed-checkpoint's is a
tumbling window.)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from functools import partial

import torch

from larql.inference.batching import IsolatedRows, RowsFailed, StepRolledBack
from larql.inference.engine import Engine, KvEngine
from larql.inference.errors import BackendUnavailable
from larql.inference.ffn import FfnBackend
from larql.inference.fused_layer import (
    fused_layer_rows,
    fused_layer_step,
    fused_layers_rows,
    layers_compile,
)
from larql.inference.layer import (
    attend,
    attention_output,
    batched_layer_step,
    effective_window,
    ffn_block,
    kept_rows,
    layer_step,
    project_qkv,
)
from larql.inference.linear import model_block_rows
from larql.inference.memory import MemoryBreakdown
from larql.inference.shared_kv import SharedKv, shares
from larql.inference.snapshots import StateReader, StateWriter
from larql.kv.buffers import KvBuffer, commit_step, step_rows, step_slots
from larql.kv.reserved_rows import rows_reserved
from larql.kv.standard.sinks import SinkKvBuffer
from larql.kv.standard.static import StaticCache
from larql.kv.standard.static_batch import BatchedStaticStep
from larql.models.model import Model


class StandardEngine(KvEngine):
    """`graph` (with `compile` and `attention`) asks for the CUDA fast path: a `StaticCache`
    where the model is on CUDA (`static=True` forces it anywhere, eager; the tests use that
    on the CPU). Prefilling from hidden rows always takes the eager path."""

    name = "standard"

    def __init__(
        self,
        window: int | None = None,
        sinks: int = 0,
        graph: bool = False,
        compile: bool = False,
        attention: str = "auto",
        static: bool | None = None,
        profiling: bool = False,
    ) -> None:
        super().__init__(profiling)
        if sinks and window is None:
            raise ValueError("sinks=S keeps S first rows beside a sliding window: give window=N")
        self.window, self.sinks = window, sinks
        self.graph, self.compile, self.attention, self.static = graph, compile, attention, static
        self._layers: list[KvBuffer | SinkKvBuffer] | None = None  # the eager path's K/V
        self._expected = 0  # tokens a generation expects to hold (`expect_tokens`)
        # (_layers, the ones among them that keep a window of rows): what `_clip` clips
        self._clipping: tuple[list, list] | None = None
        self.fast_path: StaticCache | None = None  # the static path, where it runs

    def describe(self) -> str:
        if self.fast_path is not None:
            return self.fast_path.describe()
        return "full K/V cache per layer"

    def config(self) -> str:
        if not self.window:
            return "window=full"
        return f"window={self.window}" + (f",sinks={self.sinks}" if self.sinks else "")

    def memory(self) -> MemoryBreakdown:
        if self.fast_path is not None:
            return self.fast_path.memory()
        return MemoryBreakdown.of(hot=self._layers or [])

    def window_tokens(self) -> int:
        if self.fast_path is not None:
            return min(self.position, self.window) if self.window else self.position
        return len(self._layers[0]) if self._layers else 0

    def dispatch_path(self) -> str | None:
        return self.fast_path.dispatch_path() if self.fast_path is not None else "per-layer"

    def supports_multimodal(self) -> bool:
        return True

    def extends_exactly(self, model: Model) -> bool:
        return not self._static(model)

    def _extend(
        self, model: Model, ffn: FfnBackend, rows: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        if self.fast_path is not None:
            raise BackendUnavailable("standard's static CUDA path prefills in one pass")
        return self._run(model, ffn, rows, self.position, inputs)

    def batch_key(self) -> Hashable | None:
        """Engines of one window and path batch: the eager ones together, the static (CUDA
        graph) ones together; sinks step alone."""
        if self.fast_path is not None:
            return (type(self), "static", self.window, self.fast_path.use_graph, self.attention)
        if self.sinks or self._layers is None:
            return None
        return (type(self), self.window)

    def withdraws_steps(self) -> bool:
        """The static cache holds every position's row in place and reads none past the
        position, so moving the position back undoes a step."""
        return self.fast_path is not None

    def withdraw_step(self) -> None:
        if self.fast_path is None:
            super().withdraw_step()
        self._require_prefill()
        self.position -= 1

    def prompt_batch_key(self, model: Model) -> Hashable | None:
        """A fresh eager engine's prompt may ride in the eager engines' steps."""
        if self._static(model) or self.sinks:
            return None
        return (type(self), self.window)

    def _begin_in_batch(self, model: Model) -> None:
        self.fast_path = None
        self._layers = self._new_layers(model)

    @classmethod
    def _step_batch(
        cls,
        engines: Sequence[Engine],
        model: Model,
        ffn: FfnBackend,
        rows: torch.Tensor,
        inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        """rows: [B, H] → [B, H]. Static engines: `BatchedStaticStep` (on CUDA a captured graph
        per batch size); eager ones: `_advance_batch` with a row each."""
        static = [e.fast_path for e in engines if isinstance(e, StandardEngine)]
        if all(cache is not None for cache in static):
            first = engines[0]
            assert isinstance(first, StandardEngine) and first.fast_path is not None
            step = BatchedStaticStep.of(
                model, first.window, first.fast_path.use_graph, first.attention
            )
            positions = [e.position for e in engines]
            try:
                return step.step(model, ffn, static, positions, rows, inputs)  # type: ignore[arg-type]
            except Exception as e:  # rows past a position are never read: nothing to undo
                raise StepRolledBack(f"a batched static step failed: {e}") from e
        return cls._advance_batch(engines, model, ffn, rows, [1] * len(engines), inputs)

    @classmethod
    def _advance_batch(
        cls,
        engines: Sequence[Engine],
        model: Model,
        ffn: FfnBackend,
        rows: torch.Tensor,
        counts: Sequence[int],
        inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        """Eager engines, counts[i] rows for engine i in rows [R, H] → [R, H]: each layer
        through the compiled layer where it applies, else the torch operators (projections
        and FFN once, attention per engine, each engine's isolated: `RowsFailed` names the
        engines whose own part raised). Where a shared part fails, engines that keep every
        row are cut back to their rows before the step (`StepRolledBack`)."""
        batch = [e for e in engines if isinstance(e, StandardEngine) and e._layers is not None]
        assert len(batch) == len(engines), "batch_key groups only eager standard engines"
        try:
            return cls._advance_rows(batch, model, ffn, rows, counts, inputs)
        except RowsFailed:
            raise
        except Exception as e:
            if not all(engine._keeps_every_row() for engine in batch):
                raise
            for engine in batch:
                engine._cut_back()
            raise StepRolledBack(f"a batched step failed: {e}") from e

    @staticmethod
    def _advance_rows(
        batch: list[StandardEngine],
        model: Model,
        ffn: FfnBackend,
        rows: torch.Tensor,
        counts: Sequence[int],
        inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        """`_advance_batch`'s step itself: rows [R, H] → [R, H]."""
        starts = [e.position for e in batch]
        positions = [start + j for start, n in zip(starts, counts, strict=True) for j in range(n)]
        window = batch[0].window
        layers = range(model.config.num_layers)
        h = _fused_step(model, ffn, rows, batch, starts, counts, window)
        if h is not None:  # every layer in one compiled call
            for engine in batch:
                engine._clip()
            return h
        shared = [SharedKv(model.config) for _ in batch]  # each session's, for sharing layers
        isolated = IsolatedRows()
        h = rows
        for layer in layers:
            buffers = [e._layers[layer] for e in batch]  # type: ignore[index]
            out = fused_layer_rows(model, layer, h, starts, list(counts), buffers, ffn, window)
            if out is None:
                rows_attend = partial(_attend_buffer, model, layer, buffers, starts, window, shared)
                out = batched_layer_step(
                    model, layer, h, positions, isolated(rows_attend), ffn, inputs, counts
                )
            for buffer in buffers:
                buffer.clip()
            h = out
        return isolated.check(h)

    def _keeps_every_row(self) -> bool:
        """Whether every layer keeps all its rows (no window): a step's rows can be cut."""
        return all(isinstance(b, KvBuffer) and b.keep is None for b in self._layers or [])

    def _cut_back(self) -> None:
        """Drop rows past the position from every layer (a failed step's), where they keep
        every row: each then holds positions 0..position−1 (a K/V-sharing layer: none)."""
        held = self.position if self._prefilled else 0
        for buffer in self._layers or []:
            buffer.truncate(min(len(buffer), held))

    def fork_prefix(self, model: Model, tokens: int) -> Engine | None:
        """Where every layer keeps every row (no window, no sliding layer), the first `tokens`
        rows of each are exactly the state a prefill of those tokens leaves."""
        if tokens == self.position or not 0 < tokens < self.position:
            return super().fork_prefix(model, tokens)
        layers = range(model.config.num_layers)
        if any(effective_window(model, layer, self.window) is not None for layer in layers):
            return None
        clone = super().fork_prefix(model, self.position)
        if not isinstance(clone, StandardEngine):
            return None
        clone.position = tokens
        if clone.fast_path is None:
            clone._cut_back()
        # the static path holds rows in fixed slots by position: those past it are overwritten
        return clone

    def write_state(self, state: StateWriter) -> None:
        """Each layer's live K/V rows (`layers.N.k`, `.v`; a sinks layer's under `sink` and
        `recent`), the same whether the eager or the static CUDA path holds them."""
        if self.fast_path is not None:
            layers = self.fast_path.held_rows(self.position)
        else:
            layers = list(self._layers or [])
        for layer, buffer in enumerate(layers):
            buffer.write_state(state.scope(f"layers.{layer}"))

    def read_state(self, state: StateReader, model: Model) -> None:
        """Every layer's rows: all the positions, or a window's last rows where the layer keeps
        a window (none on a layer that shares another's K/V); on a GPU where a prefill takes
        the static path, into a static cache (its graph captured again at the first step)."""
        self.fast_path, self._clipping = None, None
        self._layers = self._new_layers(model)
        self._read_layers(state, model)
        if self._static(model):
            self.fast_path = StaticCache(self.window, self.graph, self.compile, self.attention)
            self.fast_path.hold(model, list(self._layers), self.position)
            self._layers = None

    def _read_layers(self, state: StateReader, model: Model) -> None:
        assert self._layers is not None
        cfg = model.config
        for layer, buffer in enumerate(self._layers):
            held = 0 if shares(cfg, layer) else self.position
            shape = (model.dtype, cfg.kv_heads_of(layer), cfg.head_dim_of(layer))
            if isinstance(buffer, SinkKvBuffer):
                buffer.read_state(state.scope(f"layers.{layer}"), held, *shape)
            else:
                kept = held if buffer.keep is None else min(held, buffer.keep)
                buffer.read_state(state.scope(f"layers.{layer}"), kept, *shape)

    def _start_tokens(self, model: Model, ffn: FfnBackend, token_ids: list[int]) -> torch.Tensor:
        if not self._static(model):
            return super()._start_tokens(model, ffn, token_ids)
        self._layers = None
        self.fast_path = StaticCache(self.window, self.graph, self.compile, self.attention)
        return self.fast_path.start(model, ffn, token_ids)

    def _static(self, model: Model) -> bool:
        """Whether a prefill of token ids on `model` takes the static (CUDA graph) path."""
        if self.static is not None:
            return self.static
        return self.graph and model.device.type == "cuda" and not self.sinks

    def _start(
        self, model: Model, ffn: FfnBackend, rows: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """rows: [S, H] → every prompt row's hidden [S, H] (boundary frames read inside it)."""
        self.fast_path = None
        self._layers = self._new_layers(model)
        return self._run(model, ffn, rows, 0, inputs)

    def _step_token(self, model: Model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        if self.fast_path is not None:  # the static step embeds on the device
            return self.fast_path.step(model, ffn, token_id, self.position)
        return super()._step_token(model, ffn, token_id)

    def _step(
        self, model: Model, ffn: FfnBackend, row: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        if self.fast_path is not None:
            raise BackendUnavailable(
                "standard's static CUDA path decodes token ids; prefill from hidden rows to "
                "decode from hidden rows (the eager path)"
            )
        return self._run(model, ffn, row, self.position, inputs)

    def _run(
        self,
        model: Model,
        ffn: FfnBackend,
        h: torch.Tensor,
        start: int,
        inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        """Rows h [S, H] at positions start.. (per-layer inputs [S, L, P] or None) → [S, H]."""
        assert self._layers is not None
        if h.shape[0] <= model_block_rows(
            model
        ):  # every layer in one compiled call, if they take it
            fused = _fused_step(model, ffn, h, [self], [start], [h.shape[0]], self.window)
            if fused is not None:
                self._clip()
                return fused
        shared = SharedKv(model.config)  # a K/V-sharing layer's buffer stays empty
        for layer, buffer in enumerate(self._layers):
            if isinstance(buffer, SinkKvBuffer) and not shares(model.config, layer):
                q, k, v = project_qkv(model, layer, h, start)
                keys, values = buffer.append(k, v)
                allowed = buffer.allowed(start, h.shape[0])
                shared.keep(layer, keys, values, allowed)
                attn = attend(model, layer, q, keys, values, start, None, allowed)
                h = ffn_block(model, layer, attention_output(model, layer, h, attn), ffn, inputs)
            else:
                fused = fused_layer_step(model, layer, h, start, buffer, ffn, self.window)
                h = (
                    fused
                    if fused is not None
                    else layer_step(
                        model, layer, h, start, buffer, ffn, self.window, inputs, shared
                    )
                )
            buffer.clip()
        return h

    def expect_tokens(self, total: int) -> None:
        self._expected = total
        for buffer in self._layers or []:
            if isinstance(buffer, KvBuffer):
                buffer.expect(total)

    def _clip(self) -> None:
        """Drop the rows no later query sees, on the layers that keep a window (every session
        of a batch asks at every step: the layers that do are found once per set of layers)."""
        layers = self._layers or []
        if self._clipping is None or self._clipping[0] is not layers:
            windowed = [b for b in layers if not isinstance(b, KvBuffer) or b.keep is not None]
            self._clipping = (layers, windowed)
        for buffer in self._clipping[1]:
            buffer.clip()

    def _new_layers(self, model: Model) -> list[KvBuffer | SinkKvBuffer]:
        return [self._new_buffer(model, i) for i in range(model.config.num_layers)]

    def _new_buffer(self, model: Model, layer: int) -> KvBuffer | SinkKvBuffer:
        """Sinks go on the layers the engine's window bounds; a layer with its own sliding
        window keeps that window alone (its architecture never lets it see farther)."""
        if self.sinks and self.window and model.config.layers[layer].sliding_window is None:
            return SinkKvBuffer(self.sinks, self.window)
        buffer = KvBuffer(keep=kept_rows(effective_window(model, layer, self.window)))
        buffer.expect(self._expected)
        return buffer


def _fused_step(
    model: Model,
    ffn: FfnBackend,
    rows: torch.Tensor,
    batch: Sequence[StandardEngine],
    starts: list[int],
    counts: Sequence[int],
    window: int | None,
) -> torch.Tensor | None:
    """Every layer of a batched step in one compiled call (`fused_layers_rows`), or None. An
    unwindowed engine whose layers keep every row at the same places reserves its rows in all
    its layers at once (`step_slots`), not layer by layer; in a step where new prompts ride,
    the decoding sessions still do, and only the new ones reserve layer by layer."""
    layers = range(model.config.num_layers)
    if window is None:
        slots = [
            step_slots(engine._layers, n)  # type: ignore[arg-type]
            for engine, n in zip(batch, counts, strict=True)
        ]
        if all(n == 1 for n in counts) and all(slot is not None for slot in slots):
            reserved = step_rows(slots)  # type: ignore[arg-type]
        elif layers_compile(model, layers, rows, ffn):  # (new sessions' storage made here)
            layer_lists = [e._layers for e in batch]  # type: ignore[misc]
            reserved = rows_reserved(model, rows, layer_lists, counts, slots)
        else:
            reserved = None
        if reserved is not None:
            h = fused_layers_rows(model, layers, rows, starts, counts, [], ffn, window, reserved)
            if h is not None:
                for engine, n, slot in zip(batch, counts, slots, strict=True):
                    if slot is not None:
                        commit_step(engine._layers, n)  # type: ignore[arg-type]
                    else:
                        for buffer in engine._layers:  # type: ignore[union-attr]
                            buffer.commit_rows(n)
            return h
    stores = [[e._layers[layer] for e in batch] for layer in layers]  # type: ignore[index]
    return fused_layers_rows(model, layers, rows, starts, counts, stores, ffn, window)


def _attend_buffer(
    model: Model,
    layer: int,
    buffers: list[KvBuffer | SinkKvBuffer],
    starts: list[int],
    window: int | None,
    shared: list[SharedKv],
    i: int,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
) -> torch.Tensor:
    """Session i's rows of a batched step (at positions starts[i]..): their new K/V into its
    buffer, their queries over it (a K/V-sharing layer's over what its source attended over)."""
    if k is None or v is None:
        keys, values, _ = shared[i].of(layer)
    else:
        keys, values = buffers[i].append(k, v)
        shared[i].keep(layer, keys, values)
    return attend(model, layer, q, keys, values, starts[i], window)  # [n, q_dim]
