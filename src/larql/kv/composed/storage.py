"""The storage side of an eviction composed with a quantiser: the rows the eviction policy keeps
of a full-attention layer, held in the quantiser's own per-layer store (`QuantisedLayer`: its
codec, rotation, codebooks, centering, exact sinks and recent rows) and attended through the
quantiser's own decode attention (over the codes in place where its CPU extension runs, else its
torch path over the decoded rows, in the codec's rotated basis for turbo-quant). Where the
quantiser's Triton kernels take the model (CUDA), the rows of a compress-once policy keeping one
count of rows a layer go into the quantiser's kernel path instead (`on_kernels`).

Row i of each K/V head is that head's i-th kept row: the heads keep different positions, but a
decode query sees every kept row (keys carry their rotary position already), so only the count
and the order matter. A layer with the architecture's own sliding window keeps its window (the
policy does not evict there) in the quantiser's windowed store, coded as the quantiser alone
codes it (`window`), so a composition never holds more than its quantiser alone on a model of
sliding layers. Nothing of the prompt's exact K/V outlives the prefill. Sessions of one
composition decode in a batch (`step_batch`): the projections and the FFN once for every row,
each row attending over its own engine's coded rows.

A policy that evicts as it decodes (`h2o`, `tova`: `drops`) decodes on the torch path, whose
decoded keys give the weights it rescores the rows by, and its stores drop the rows it evicts
(`larql.kv.composed.dropping`)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from functools import partial

import torch

from larql.inference.batching import IsolatedRows
from larql.inference.ffn import FfnBackend
from larql.inference.layer import attend, batched_layer_step
from larql.inference.memory import MemoryBreakdown, tensor_bytes
from larql.inference.shared_kv import SharedKv
from larql.inference.snapshots import StateReader, StateWriter
from larql.kernels.cpu import cpu_extension
from larql.kv.composed.dropping import drop_rows
from larql.kv.composed.on_kernels import ExactKept, kernels_take, resettle, settle
from larql.kv.composed.ragged import RaggedCodes
from larql.kv.eviction.base import EvictingEngine
from larql.kv.eviction.ragged import RaggedRows
from larql.kv.eviction.scored import ScoredRows
from larql.kv.eviction.scores import attention_mass
from larql.kv.kv_quant.compiled import attend_grouped, grouped_in_place
from larql.kv.kv_quant.engine import KvQuantEngine
from larql.kv.turbo_quant.codec import TurboQuantCodec
from larql.kv.turbo_quant.coded_cpu import attend_coded, codes_in_place
from larql.kv.turbo_quant.engine import TurboQuantEngine, kernel_path_label
from larql.kv.turbo_quant.kernel_batch import BatchedKernelStep
from larql.kv.turbo_quant.kernel_path import KernelPath
from larql.kv.turbo_quant.rotation import rotation_matrix
from larql.kv.turbo_quant.store import KvLayout, QuantisedLayer, rotate
from larql.models.model import Model


class KeptCodes(QuantisedLayer):
    """One layer's kept rows in a quantiser's store, with the row count a saved state needs
    (how many rows eviction kept is not a function of the position). Under a policy that
    evicts as it decodes (`drops`) it also holds each row's score [Hkv, n] float32 and the
    weights the last decode query put on its rows (`weights` [Hkv, n]), and drops rows
    (`keep`, `larql.kv.composed.dropping`)."""

    def __init__(
        self,
        layout: KvLayout,
        kv_heads: int,
        dtype: torch.dtype,
        compiled: bool = False,
        drops: bool = False,
        keep: int | None = None,
    ) -> None:
        # every kept row (None), or a sliding layer's last `keep` rows
        super().__init__(layout, keep, kv_heads, dtype, compiled)
        self.drops = drops  # the policy drops rows as it decodes
        self.score: torch.Tensor | None = None  # [Hkv, n] float32, where the policy drops rows
        self.weights: torch.Tensor | None = None  # [Hkv, n]: the last step's attention

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """`QuantisedLayer.append`; a scored row enters at score 0 (the policy rescores it)."""
        super().append(k, v)
        if self.score is not None:
            fresh = self.score.new_zeros(self.kv_heads, k.shape[1])
            self.score = torch.cat((self.score, fresh), dim=1)

    def keep(self, index: torch.Tensor) -> None:
        """index [Hkv, m]: the rows each head keeps, in order (`ScoredRows.keep`)."""
        drop_rows(self, index)
        if self.score is not None:
            self.score = torch.gather(self.score, 1, index)

    def nbytes(self) -> int:
        return self.memory().total

    def live_nbytes(self) -> int:
        return self.memory().state

    def memory(self) -> MemoryBreakdown:
        return super().memory() + MemoryBreakdown(hot=tensor_bytes(self.score))

    def write_state(self, state: StateWriter) -> None:
        """`rows` (the count), the store's tensors (`QuantisedLayer.write_state`) and, where the
        policy drops rows, `score` [n, Hkv] float32."""
        state.put("rows", len(self))
        super().write_state(state)
        if self.score is not None:
            state.tensor("score", self.score.transpose(0, 1))

    def read_state(self, state: StateReader, tokens: int) -> None:
        """`QuantisedLayer.read_state`; a store that dropped sink rows holds fewer of them (and
        takes no new ones)."""
        if self.drops:
            room = min(tokens, self.sink_room)
            held = state.row_count("sinks", 0, room)
            if held < room:
                self.sink_room = held
        super().read_state(state, tokens)

    def read_score(self, state: StateReader) -> None:
        """The rows' `score` as `write_state` wrote it."""
        score = state.rows("score", torch.float32, len(self), (self.kv_heads,))
        if score is None:
            self.score = torch.zeros(self.kv_heads, 0, device=self._device())
        else:
            self.score = score.transpose(0, 1).contiguous()  # [Hkv, n]


class QuantisedStorage:
    """A `KeptStorage` (`larql.kv.eviction.base`) coding the kept rows with `quantiser`'s
    layout. It holds no rows itself (each layer's `KeptCodes` does), so forks share it."""

    def __init__(
        self, quantiser: TurboQuantEngine, adaptive: bool = False, drops: bool = False
    ) -> None:
        self.quantiser = quantiser
        # the policy keeps another count of rows on each head (`heads=adaptive`): its layers'
        # rows are `RaggedCodes`, except a layer whose K/V a later layer shares (kept uniform)
        self.adaptive = adaptive
        # the policy evicts as it decodes (`h2o`, `tova`): the stores keep each row's score
        # and drop rows; decode attends on the torch path, which gives the weights it rescores
        # by (the attention over the rows the store holds, as decoded)
        self.drops = drops
        self._layouts: dict[int, KvLayout] = {}  # head_dim → the quantiser's layout

    def describe(self, fast: KernelPath | None = None) -> str:
        """What codes the kept rows and (`fast`: the engine's kernel path) attends them."""
        q = self.quantiser
        path = q.describe() if fast is None else f"{q.codes_label()}, {kernel_path_label(fast)}"
        return f"kept rows coded by {q.name}: {path}"

    def config(self) -> str:
        return self.quantiser.config()

    def batch_key(self) -> Hashable:
        return (type(self.quantiser), self.quantiser.config(), self.quantiser.rotated_attention)

    # ------------------------------------------------------------------ batched decode

    def step_batch(
        self,
        engines: Sequence[EvictingEngine],
        model: Model,
        ffn: FfnBackend,
        rows: torch.Tensor,
        inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        """rows [B, H], row i engine i's next token → [B, H]: projections and FFN once for
        every row, each row attending over its own engine's rows (`_attend_row`); an engine
        whose part fails fails alone (`IsolatedRows`). Engines on the quantiser's kernel path
        (`settle`; the batch key keeps them together) take its batched step."""
        paths = [e._fast for e in engines]
        if paths[0] is not None:
            kernel_paths = [path for path in paths if isinstance(path, KernelPath)]
            assert len(kernel_paths) == len(engines), "batch_key groups kernel-path engines"
            step = BatchedKernelStep.of(model, engines[0].batch_key(), kernel_paths[0])
            return step.step(model, ffn, kernel_paths, [e.position for e in engines], rows)
        shared = [SharedKv(model.config) for _ in engines]  # each session's, for sharing layers
        positions = [e.position for e in engines]
        isolated = IsolatedRows()
        h = rows
        for layer in range(model.config.num_layers):
            attend_row = partial(self._attend_row, engines, model, layer, shared)
            h = batched_layer_step(model, layer, h, positions, isolated(attend_row), ffn, inputs)
        return isolated.check(h)

    def _attend_row(
        self,
        engines: Sequence[EvictingEngine],
        model: Model,
        layer: int,
        shared: list[SharedKv],
        i: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
    ) -> torch.Tensor:
        """Engine i's attention for its row at `layer` (q [Hq, 1, D]; k, v [Hkv, 1, D], or None
        on a layer attending its source's rows) → [1, q_dim], as its own `_step` attends."""
        engine, held = engines[i], engines[i]._layers[layer]
        if k is None or v is None:
            keys, values, allowed = shared[i].of(layer)
            return attend(model, layer, q, keys, values, engine.position, None, allowed)
        attn = self.attend(model, layer, held, q, k, v, engine.position, shared[i])
        if model.config.layers[layer].sliding_window is None:
            engine._attended(model, layer, held, q)  # a policy that evicts as it decodes: here
        return attn

    # ------------------------------------------------------------------ the stores

    def _empty(
        self, model: Model, layer: int, heads: int | None = None, keep: int | None = None
    ) -> KeptCodes:
        """A new store of the layer's K/V heads (or of `heads` of them); with `keep`, a sliding
        layer's store of its last `keep` rows (the policy drops none there)."""
        width = model.config.head_dim_of(layer)
        layout = self._layouts.get(width)
        if layout is None:
            layout = self._layouts[width] = self.quantiser._kv_layout(width)
        compiled = self.quantiser._compiled(model, layout)
        kv_heads = model.config.kv_heads_of(layer) if heads is None else heads
        drops = self.drops and keep is None
        return KeptCodes(layout, kv_heads, model.dtype, compiled, drops=drops, keep=keep)

    def _waits(self, model: Model) -> bool:
        """Whether the prompt's kept rows wait as they are for the quantiser's kernel path
        (`on_kernels`): a policy that keeps its rows once, on a model the kernels take."""
        return not self.drops and kernels_take(self.quantiser, model)

    def settle(self, model: Model, layers: list, prompt_length: int) -> KernelPath | None:
        """The prompt's layers, each kept (rows waiting for the kernel path as `ExactKept`) →
        the kernel path holding them (the waiting layers then None), or None with the waiting
        layers coded into the torch path's stores."""
        return settle(self.quantiser, model, layers, prompt_length, partial(self._coded, model))

    def resettle(self, model: Model, layers: list, position: int) -> KernelPath | None:
        """The stores read back from a saved state → the kernel path holding them where
        `settle` would have put them there (their entries then None), else None."""
        if self.drops or not kernels_take(self.quantiser, model):
            return None
        return resettle(self.quantiser, model, layers, position)

    def _coded(self, model: Model, layer: int, rows: ExactKept) -> KeptCodes:
        """Rows that waited for the kernel path, coded into the torch path's store instead."""
        if rows.window is not None:
            return self._window_store(model, layer, rows.keys, rows.values, rows.window)
        store = self._empty(model, layer)
        store.append(rows.keys, rows.values)
        return store

    def window(
        self, model: Model, layer: int, keys: torch.Tensor, values: torch.Tensor, keep: int
    ) -> KeptCodes | ExactKept:
        """A sliding layer's rows keys, values [Hkv, n, D] → a store of its last `keep` rows,
        coded as the quantiser alone codes that layer (or the rows, waiting for the kernel
        path)."""
        if self._waits(model):
            return ExactKept(keys, values, window=keep)
        return self._window_store(model, layer, keys, values, keep)

    def _window_store(
        self, model: Model, layer: int, keys: torch.Tensor, values: torch.Tensor, keep: int
    ) -> KeptCodes:
        store = self._empty(model, layer, keep=keep)
        store.append(keys, values)
        return store

    def read_window(
        self, state: StateReader, model: Model, layer: int, keep: int, tokens: int
    ) -> KeptCodes:
        """What `window` gave, back from a saved state after `tokens` tokens."""
        store = self._empty(model, layer, keep=keep)
        held = min(tokens, keep)
        state.integer("rows", held, held)  # (the window's rows, as `write_state` counts them)
        store.read_state(state, tokens)
        return store

    def hold(self, model: Model, layer: int, rows) -> KeptCodes | RaggedCodes | ExactKept:
        """The policy's rows (`.keys`, `.values` [Hkv, n, D], or a `RaggedRows` of each head's
        own count; with `.score` [Hkv, n] where it drops rows) coded into new stores, or
        waiting as they are for the kernel path (`settle`)."""
        if not isinstance(rows, RaggedRows) and self._waits(model):
            return ExactKept(rows.keys, rows.values)
        kept_whole = self.drops and self.adaptive and isinstance(rows, ScoredRows)
        if kept_whole and not SharedKv(model.config).is_source(layer):
            rows = _every_row(rows)  # the prompt fit: each head's rows its own store yet
        if isinstance(rows, RaggedRows):
            return RaggedCodes.held(rows, partial(self._empty, model, layer))
        store = self._empty(model, layer)
        store.append(rows.keys, rows.values)
        if self.drops:
            store.score = rows.score.float()
        return store

    def read(
        self, state: StateReader, model: Model, layer: int, most: int
    ) -> KeptCodes | RaggedCodes:
        # a layer the policy kept whole is held as one store even under heads=adaptive
        if self.adaptive and state.has_field("ragged.tail.rows"):
            make = partial(self._empty, model, layer)
            heads = model.config.kv_heads_of(layer)
            return RaggedCodes.read_state(state, make, heads, most, self.drops)
        store = self._empty(model, layer)
        store.read_state(state, state.integer("rows", 0, most))
        if self.drops:
            store.read_score(state)
        return store

    # ------------------------------------------------------------------ decode attention

    def attend(
        self,
        model: Model,
        layer: int,
        held: KeptCodes | RaggedCodes,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        position: int,
        shared: SharedKv,
    ) -> torch.Tensor:
        """q [Hq, 1, D] over the held rows and the new row k, v [Hkv, 1, D] → [1, q_dim], as
        the quantiser's own step attends; the new row is then coded into `held`."""
        if isinstance(held, RaggedCodes):  # never a K/V source: each head its own rows
            rotation = self._rotation(held.tail, model.device)
            return held.attend(model, layer, q, k, v, rotation)
        # a layer whose K/V a later layer shares hands on rows in the model's basis
        rotation = None if shared.is_source(layer) else self._rotation(held, model.device)
        drops = held.drops  # the policy rescores these rows (never a sliding layer's window)
        attn = None if drops else self._in_place(model, layer, held, q, k, v, rotation, shared)
        if attn is None:
            keys, values = held.keys_values(model.dtype, rotation)  # [Hkv, n, D']
            new_k, new_v = k, v
            if rotation is not None:
                new_k = rotate(k, rotation).to(model.dtype)
                new_v = rotate(v, rotation).to(model.dtype)
            keys, values = torch.cat((keys, new_k), dim=1), torch.cat((values, new_v), dim=1)
            shared.keep(layer, keys, values)
            attn = _attend_in_basis(model, layer, q, keys, values, position, rotation)
            if drops:  # the weights this step's query puts on the rows held, the new one
                query = q if rotation is None else rotate(q, rotation).to(model.dtype)
                held.weights = attention_mass(model, query, keys, keys.shape[1] - 1)
        held.append(k, v)  # the exact new row, coded as the quantiser codes it
        return attn

    def _rotation(self, held: KeptCodes, device: torch.device) -> torch.Tensor | None:
        """R [D', D'] float32 where the quantiser attends in its codec's rotated basis."""
        codec = held.layout.k_codec
        if not (self.quantiser.rotated_attention and isinstance(codec, TurboQuantCodec)):
            return None
        return rotation_matrix(codec.rotated_dim, torch.float32, device)

    def _in_place(
        self,
        model: Model,
        layer: int,
        held: KeptCodes,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotation: torch.Tensor | None,
        shared: SharedKv,
    ) -> torch.Tensor | None:
        """The attention over the codes in the CPU extension, where it applies; else None."""
        if isinstance(self.quantiser, KvQuantEngine):
            grouped = cpu_extension() if grouped_in_place(model, layer, held, shared) else None
            return None if grouped is None else attend_grouped(grouped, model, layer, held, q, k, v)
        coded = cpu_extension() if codes_in_place(model, layer, held, rotation, shared) else None
        if coded is None or rotation is None:
            return None
        return attend_coded(coded, model, layer, held, q, k, v, rotation)


def _attend_in_basis(
    model: Model,
    layer: int,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: int,
    rotation: torch.Tensor | None,
) -> torch.Tensor:
    """q [Hq, 1, D] over keys, values [Hkv, n, D'] in the basis `rotation` gives (None: the
    model's own) → [1, q_dim] (turbo-quant's `_attend_in_basis`)."""
    if rotation is None:
        return attend(model, layer, q, keys, values, position, None)
    cfg, dtype = model.config, model.dtype
    q_rot = rotate(q, rotation).to(dtype)
    attn = attend(model, layer, q_rot, keys, values, position, None)  # [1, Hq·D']
    back = attn.view(cfg.num_heads, -1).float() @ rotation  # [Hq, D'] (R·R = I)
    return back[:, : cfg.head_dim_of(layer)].to(dtype).reshape(1, cfg.q_dim_of(layer))


def _every_row(rows: ScoredRows) -> RaggedRows:
    """Every row of rows (keys, values [Hkv, n, D], score [Hkv, n]) packed per head, with its
    score: the per-head stores a policy dropping rows across heads (`heads=adaptive`) holds."""
    heads, n = rows.score.shape
    device = rows.keys.device
    head = torch.arange(heads, device=device).repeat_interleave(n)  # [Hkv·n]
    position = torch.arange(n, device=device).repeat(heads)
    return RaggedRows.picked(rows.keys, rows.values, head, position, rows.score)
