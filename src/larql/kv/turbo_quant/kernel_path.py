"""turbo-quant's decode step where the Triton kernels run (CUDA): the packed codes in fixed
slots, the exact rows (sinks and the newest) in a fixed ring, three launches per layer for
attention and encoding, the whole step captured in a CUDA graph.

The layout is the torch path's (`QuantisedLayer`): token t < sinks exact; the `recent` tokens
before the query exact; the tokens between coded (minus the prompt's mean row with centering).
Each layer's codes live in a `CodeSlots` buffer, uint8 [slots, row_bytes] laid out by plane
(`planes`: each head's codes, then the norms, token by token), token t in slot t mod slots: on
a full-attention layer slots is the capacity (≥ every position; it doubles when the position
reaches it, and the graph is captured again), on a sliding layer the coded rows a later query
can still see (a ring; smaller while the capacity is). The exact rows live in
`Levers.exact`, [sinks + recent + 1, 2, Hkv, D] at 16 bits: sink t in slot t, recent token t in
slot sinks + t mod (recent + 1) — one slot spare, so a step writes its new row where the row
that left the ring a step before was (`ring_slots`); with `recent_bits=8` the recent rows live
in `Levers.ring` instead, int8 with a float16 scale per head vector (slot t mod (recent + 1)),
the values `QuantisedLayer` keeps.
The step reads its token and position from device tensors (`StepInputs`), so `kernels.attention`
attends over what the position says is held and moves the row leaving the exact ones into the codes
inside the graph: no host sync, no allocation, one replay per token. The bytes held are those
rows', as on the torch path; the slots not yet filled are the growth reserve.
Sessions of one configuration also decode together (`kernel_batch.BatchedKernelStep`): the same
launches over every session's state, found by offsets (`batch_meta`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from larql.inference.ffn import FfnBackend
from larql.inference.layer import (
    attention_output,
    embed,
    ffn_block,
    project_qkv_with_rope,
)
from larql.inference.memory import MemoryBreakdown, tensor_bytes
from larql.inference.profiling import EngineProfiler
from larql.inference.snapshots import StateWriter
from larql.kernels.ran import TRITON, ran
from larql.kv.captured_step import (
    CapturedStep,
    RopeAtPosition,
    StepInputs,
    initial_capacity,
    reserve_rope,
)
from larql.kv.turbo_quant import planes
from larql.kv.turbo_quant.codec import NORM_BYTES
from larql.kv.turbo_quant.layout import ring_slots, token_vectors
from larql.kv.turbo_quant.recent import int8_decode, int8_encode
from larql.kv.turbo_quant.store import KvLayout, QuantisedLayer, exact_dtype, rotate
from larql.models.model import Model

if TYPE_CHECKING:  # the kernels import Triton: only where they run
    from larql.kv.turbo_quant.kernels import CodecTables, Operands


class CodeSlots:
    """One layer's encoded rows: uint8 [slots, row_bytes] by plane (`planes`, vectors of
    `header` bytes before their codes), token t in slot t mod slots. `keep`: the coded rows a
    sliding layer retains (None: every row)."""

    def __init__(
        self,
        keep: int | None,
        bytes_per_vector: int,
        kv_heads: int,
        device: torch.device,
        header: int = NORM_BYTES,
    ) -> None:
        self.keep = keep
        self.bytes_per_vector = bytes_per_vector
        self.header = header
        self.row_bytes = 2 * kv_heads * bytes_per_vector
        self.device = device
        self.data = torch.zeros((0, self.row_bytes), dtype=torch.uint8, device=device)

    @property
    def slots(self) -> int:
        return self.data.shape[0]

    def nbytes(self) -> int:
        return self.data.numel()

    def reserve(self, capacity: int) -> None:
        """Room for positions < capacity: `capacity` slots, or `keep` on a sliding layer.
        Called only while no row has wrapped (every written slot t holds token t)."""
        slots = capacity if self.keep is None else min(self.keep, capacity)
        if slots == self.slots:
            return
        data = torch.zeros((slots, self.row_bytes), dtype=torch.uint8, device=self.device)
        held = self.slots  # every plane's first `held` slots move
        bpv, header = self.bytes_per_vector, self.header
        planes.code_planes(data, bpv, header)[:, :held] = planes.code_planes(self.data, bpv, header)
        planes.header_planes(data, bpv, header)[:, :held] = planes.header_planes(
            self.data, bpv, header
        )
        self.data = data

    def write(self, rows: torch.Tensor, first: int) -> None:
        """rows: [S, row_bytes] in the codec's row format, tokens first … first + S − 1 → the
        last `slots` of them, each in its slot."""
        s = rows.shape[0]
        kept = min(s, self.slots)
        tokens = torch.arange(first + s - kept, first + s, device=self.device)
        planes.write_rows(
            self.data, tokens % self.slots, rows[s - kept :], self.bytes_per_vector, self.header
        )

    def tokens(self, first: int, end: int) -> torch.Tensor:
        """The rows of tokens first … end − 1, oldest first, in the codec's row format: uint8
        [end − first, row_bytes]."""
        tokens = torch.arange(first, end, device=self.device)
        slots = tokens % max(self.slots, 1)
        return planes.read_rows(self.data, slots, self.bytes_per_vector, self.header)


@dataclass(frozen=True)
class LayerLayout:
    """Where one layer's tokens are at a position: sinks, codes, recent rows."""

    sinks: int
    recent: int
    keep: int | None  # rows before its own a query sees (None: all)

    def coded(self, position: int) -> tuple[int, int]:
        """The coded tokens [first, end) while the next token is `position`."""
        first = self.sinks if self.keep is None else max(0, position - self.keep)
        end = max(first, position - self.recent)
        return first, end

    def sink_rows(self, position: int) -> int:
        return min(position, self.sinks)

    def recent_tokens(self, position: int) -> tuple[int, int]:
        """The exact newest tokens [first, end)."""
        return max(self.sink_rows(position), position - self.recent), position

    def exact_slot(self, token: int) -> int:
        """Sink t in slot t; recent token t in slot sinks + t mod ring_slots(recent)."""
        return token if token < self.sinks else self.sinks + token % ring_slots(self.recent)


class KernelPath:
    """The decode state and step of a `TurboQuantEngine` on the Triton kernels. `kernels`: the
    module of the codec's launches — turbo-quant's (`turbo_quant.kernels`) or kv-quant's
    grouped integer codes (`kv_quant.kernels`), which share its workspace, levers, operands and
    launch signatures (`supports`, `CodecTables.of`, `attention`, `batched_attention`,
    `encode`, `cuda_partial_kernel`)."""

    def __init__(
        self,
        kernels: ModuleType,
        layout: KvLayout,
        model: Model,
        keeps: list[int | None],
        use_graph: bool,
        profiler: EngineProfiler,
        use_cuda_partial: bool = True,
    ) -> None:
        """`use_cuda_partial`: full-attention layers take the CUDA C++ partial launch where it
        covers them and builds here (False: the Triton launches everywhere)."""
        codec = layout.k_codec
        assert kernels.supports(codec)
        self._kernels = kernels
        self.kv_layout, self.keeps = layout, keeps
        self._tables = kernels.CodecTables.of(codec, model.device)
        self._center = layout.center
        self._ring8 = layout.recent_bits == 8
        cfg = model.config
        self._workspace = kernels.Workspace.of(
            cfg.num_heads, cfg.num_kv_heads, self._tables, model.device
        )
        self.layouts = [layer_layout(layout, keep) for keep in keeps]
        self.layers = [
            CodeSlots(
                None if keep is None else keep - where.recent,
                codec.bytes_per_vector,
                cfg.num_kv_heads,
                model.device,
                self._tables.header_bytes,
            )
            for keep, where in zip(keeps, self.layouts, strict=True)
        ]
        exact = exact_dtype(model.dtype)
        self.levers = [
            self._levers(where, cfg.num_kv_heads, cfg.head_dim, exact, model.device)
            for where in self.layouts
        ]
        # each layer's launch `meta` (its tensors' own: offsets 0, and the store's slots)
        self._metas = [kernels.single_meta(slots.data) for slots in self.layers]
        self._batch_rows: tuple[Operands, torch.Tensor] | None = None  # (`batch_meta`'s cache)
        self._inputs = StepInputs(model.device)
        self._graph = CapturedStep()
        self._use_graph = use_graph and not profiler.enabled  # the graph has no stages
        self._profiler = profiler
        self._capacity = 0
        self.position = 0  # the next token's
        # rows a layer holds = position − its offset: an eviction composed with this codec
        # keeps fewer rows than the prompt's tokens (`start`'s `rows`); 0 everywhere otherwise
        self._offsets = [0] * len(keeps)
        self._offsets_on_device = torch.zeros(len(keeps), dtype=torch.long, device=model.device)
        self._rows_at = torch.zeros(len(keeps), dtype=torch.long, device=model.device)  # [L]
        self.partial_in_cuda = use_cuda_partial and self._partial_in_cuda(model)

    @staticmethod
    def supports(kernels: ModuleType, layout: KvLayout, keeps: list[int | None]) -> bool:
        """The kernels handle this codec (one for K and V), and every sliding layer keeps at
        least one coded row."""
        codec, values = layout.k_codec, layout.v_codec
        if not (kernels.supports(codec) and kernels.supports(values)):
            return False
        if values is not codec and (type(values) is not type(codec) or values.bits != codec.bits):
            return False
        return all(keep is None or keep > layer_layout(layout, keep).recent for keep in keeps)

    @property
    def captured(self) -> bool:
        return self._graph.captured

    @property
    def use_graph(self) -> bool:
        return self._use_graph

    def _partial_in_cuda(self, model: Model) -> bool:
        """Whether a full-attention layer's step runs the CUDA C++ partial launch
        (`cuda_partial`, compiled here at first use) rather than the Triton rotation and
        partial launches."""
        full = [lv for lv in self.levers if lv.keep == self._kernels.FULL_LAYER_KEEP]
        if not full:
            return False
        cfg = model.config
        kernel = self._kernels.cuda_partial_kernel(
            model.device,
            model.dtype,
            full[0].exact.dtype,
            cfg.num_heads,
            cfg.num_kv_heads,
            self._tables,
            full[0],
            cfg.arch.attn_softcap or 0.0,
            self._workspace.m.shape[-1],
        )
        return kernel is not None

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def tables(self) -> CodecTables:
        """The codec's tables on the device."""
        return self._tables

    def batch_meta(self, operands: Operands) -> torch.Tensor:
        """Every layer's row of a batched launch's `meta` reaching the session's state from
        `operands`: int64 [L, META] on the host, kept until the store is reallocated."""
        if self._batch_rows is None or self._batch_rows[0] is not operands:
            rows = [
                operands.offsets(slots.data, levers)
                for slots, levers in zip(self.layers, self.levers, strict=True)
            ]
            self._batch_rows = (operands, torch.tensor(rows, dtype=torch.long))
        return self._batch_rows[1]

    @property
    def shifted(self) -> bool:
        """Whether some layer holds fewer rows than the position (`start`'s `rows`)."""
        return any(self._offsets)

    @property
    def offsets(self) -> list[int]:
        """Each layer's prompt rows not kept: it holds `position − offset` rows."""
        return list(self._offsets)

    def batch_key(self) -> Hashable:
        """What paths stepping together must agree on besides their engines' configuration."""
        return ("kernels", self.use_graph, self.partial_in_cuda)

    def rows(self, layer: int) -> int:
        """The rows layer `layer` holds (its layout's position): the token position less the
        prompt's rows it did not keep."""
        return self.position - self._offsets[layer]

    def _least_offset(self) -> int:
        """The least offset of a full-attention layer (the one holding the most rows): the
        capacity counts its rows."""
        full = [o for o, keep in zip(self._offsets, self.keeps, strict=True) if keep is None]
        return min(full, default=0)

    def ensure_room(self, model: Model, position: int) -> None:
        """Room in every store for the token at `position` (a full layer's doubles)."""
        while position - self._least_offset() >= self._capacity:
            self._reserve(model, self._capacity * 2)

    def memory(self) -> MemoryBreakdown:
        live = reserved = 0
        for layer, (slots, where, levers) in enumerate(
            zip(self.layers, self.layouts, self.levers, strict=True)
        ):
            rows = self.rows(layer)
            first, end = where.coded(rows)
            coded = (end - first) * slots.row_bytes
            recent_first, recent_end = where.recent_tokens(rows)
            sink_row = levers.exact[0].numel() * levers.exact.element_size()
            recent_row = sink_row
            if levers.ring is not None and levers.ring_scales is not None:
                recent_row = levers.ring[0].numel() + 2 * levers.ring_scales[0].numel()
            exact = where.sink_rows(rows) * sink_row + (recent_end - recent_first) * recent_row
            # (the 1-row stand-ins of an empty part are not state)
            ring = ring_slots(where.recent) if where.recent else 0
            exact_held = where.sinks * sink_row + ring * recent_row
            mean = tensor_bytes(levers.mean) if self._center else 0
            live += coded + exact + mean
            reserved += slots.nbytes() - coded + exact_held - exact
        return MemoryBreakdown(hot=live, reserved=reserved)

    def stored_rows(self, layer: int) -> int:
        where, rows = self.layouts[layer], self.rows(layer)
        first, end = where.coded(rows)
        recent_first, recent_end = where.recent_tokens(rows)
        return where.sink_rows(rows) + end - first + recent_end - recent_first

    def codes_in_token_order(self, layer: int) -> torch.Tensor:
        """The coded rows, oldest first: uint8 [n, row_bytes]."""
        first, end = self.layouts[layer].coded(self.rows(layer))
        return self.layers[layer].tokens(first, end)

    def exact_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sink rows, recent rows), oldest first: [n, 2, Hkv, D], the sinks at 16 bits, the
        recent rows at 16 bits or decoded from int8 (float32)."""
        where, levers, rows = self.layouts[layer], self.levers[layer], self.rows(layer)
        sinks = levers.exact[: where.sink_rows(rows)]
        index = self._recent_slots(layer)[0]
        if levers.ring is None or levers.ring_scales is None:
            return sinks, levers.exact[index]
        ring = index - where.sinks
        return sinks, int8_decode(levers.ring[ring], levers.ring_scales[ring].unsqueeze(-1))

    def _recent_slots(self, layer: int) -> tuple[torch.Tensor, int, int]:
        """The exact slots of the layer's recent rows, oldest first: (long [n], first token,
        end token)."""
        where, rows = self.layouts[layer], self.rows(layer)
        first, end = where.recent_tokens(rows)
        slots = [where.exact_slot(t) for t in range(first, end)]
        device = self.levers[layer].exact.device
        return torch.tensor(slots, dtype=torch.long, device=device), first, end

    def mean(self, layer: int) -> torch.Tensor | None:
        """The layer's centering rows [2, Hkv, D] float32, or None."""
        return self.levers[layer].mean if self._center else None

    # ------------------------------------------------------------------ saved state

    def write_layer_state(self, layer: int, state: StateWriter) -> None:
        """The layer's rows as the torch path's store writes them (`QuantisedLayer.write_state`:
        `sinks`, `codes`, `recent.codes` — and at 8 bits `recent.scales` — and `mean`), so a
        state saved on either path reads back on either."""
        where, levers = self.layouts[layer], self.levers[layer]
        state.tensor("sinks", levers.exact[: where.sink_rows(self.rows(layer))])
        state.tensor("codes", self.codes_in_token_order(layer))
        slots, _, _ = self._recent_slots(layer)
        recent = state.scope("recent")
        if levers.ring is None or levers.ring_scales is None:
            recent.tensor("codes", levers.exact[slots])  # [n, 2, Hkv, D]
        else:
            ring = slots - where.sinks
            recent.tensor("codes", levers.ring[ring])  # [n, 2, Hkv, D] int8
            recent.tensor("scales", levers.ring_scales[ring].unsqueeze(-1))  # [n, 2, Hkv, 1]
        state.tensor("mean", self.mean(layer))

    def take_layer(self, layer: int, store: QuantisedLayer) -> bool:
        """The rows of a torch-path store (read back from a saved state) into the layer's slots,
        where they are laid out as this path lays out `rows(layer)` rows → whether they were: a
        store cut back to a prefix keeps rows coded that this path would hold exact (then
        nothing is taken)."""
        where, levers, rows = self.layouts[layer], self.levers[layer], self.rows(layer)
        first, end = where.coded(rows)
        slots, recent_first, recent_end = self._recent_slots(layer)
        counts = (where.sink_rows(rows), end - first, recent_end - recent_first)
        if (len(store.sinks), len(store.codes), len(store.recent)) != counts:
            return False
        if counts[0]:
            levers.exact[: counts[0]] = store.sinks.rows
        if counts[2]:
            recent = store.recent
            if levers.ring is None or levers.ring_scales is None:
                levers.exact[slots] = recent.codes.rows.to(levers.exact.dtype)
            else:
                ring = slots - where.sinks
                levers.ring[ring] = recent.codes.rows  # int8 [n, 2, Hkv, D]
                levers.ring_scales[ring] = recent.scales.rows.squeeze(-1)
        if counts[1]:
            self.layers[layer].write(store.codes.rows, first)  # [n, row_bytes]
        if self._center and store.mean is not None:
            levers.mean.copy_(store.mean)
            levers.mean_rotated.copy_(rotate(store.mean, self._tables.rotation))
        return True

    def start(self, model: Model, prompt_length: int, rows: list[int] | None = None) -> None:
        """Stores for a prompt of `prompt_length` tokens of which layer i keeps rows[i] (None:
        every token; `store_prompt` then takes each layer's kept rows as tokens 0 … rows[i] − 1,
        and its later rows follow them whatever their position)."""
        kept = [prompt_length] * len(self.layers) if rows is None else rows
        self._offsets = [prompt_length - n for n in kept]
        self._offsets_on_device.copy_(torch.tensor(self._offsets, dtype=torch.long))
        self._reserve(model, initial_capacity(prompt_length - self._least_offset()))
        self.position = prompt_length

    def store_prompt(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [Hkv, S, D], the prompt's exact rows → the sinks and newest rows exact, the
        rows between encoded into the layer's slots."""
        s = k.shape[1]
        where, levers = self.layouts[layer], self.levers[layer]
        rows = torch.stack((k, v)).permute(2, 0, 1, 3)  # [S, 2, Hkv, D]
        mean = None
        if self._center:
            mean = rows.float().mean(dim=0)  # [2, Hkv, D]
            levers.mean.copy_(mean)
            levers.mean_rotated.copy_(rotate(mean, self._tables.rotation))
        sinks = where.sink_rows(s)
        levers.exact[:sinks] = rows[:sinks].to(levers.exact.dtype)
        first, end = where.recent_tokens(s)
        slots = torch.tensor(
            [where.exact_slot(t) for t in range(first, end)], dtype=torch.long, device=k.device
        )
        if levers.ring is None or levers.ring_scales is None:
            levers.exact[slots] = rows[first:end].to(levers.exact.dtype)
        elif end > first:
            codes, scales = int8_encode(rows[first:end])  # [n, 2, Hkv, D], [n, 2, Hkv, 1]
            levers.ring[slots - where.sinks] = codes
            levers.ring_scales[slots - where.sinks] = scales.squeeze(-1)
        first, end = where.coded(s)
        vectors = token_vectors(k[:, first:end], v[:, first:end])  # [n·2·Hkv, D]
        centers = None if mean is None else mean.reshape(-1, mean.shape[-1])  # [2·Hkv, D]
        encoded = self._kernels.encode(vectors, self._tables, centers)
        slots = self.layers[layer]
        slots.write(encoded.view(end - first, slots.row_bytes), first)  # [n, row_bytes]

    def decode(
        self,
        model: Model,
        ffn: FfnBackend,
        position: int,
        token_id: int = 0,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The token `token_id` (or the residual row `hidden` [1, H]) at `position` through every
        layer, its K/V stored. → hidden [1, H]"""
        ran(TRITON)  # the codec's Triton launches, replayed in a graph or not
        self.ensure_room(model, position)
        self._inputs.set(token_id, position)
        preserve = [s.data for s in self.layers] + [lv.exact for lv in self.levers]
        preserve += [t for lv in self.levers for t in (lv.ring, lv.ring_scales) if t is not None]
        if hidden is not None:
            out = self._step(model, ffn, hidden)
        elif self._use_graph and self._graph.ready(
            model, ffn, lambda: self._step(model, ffn), preserve=preserve
        ):
            out = self._graph.replay()
        else:
            out = self._step(model, ffn)
        self.position = position + 1
        return out

    def _step(
        self, model: Model, ffn: FfnBackend, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Every layer at the position in `self._inputs`, every shape static. → hidden [1, H]"""
        cfg = model.config
        stage, device = self._profiler.stage, model.device
        position = self._inputs.position
        rope = RopeAtPosition(position)
        shifted = self.shifted
        if shifted:  # each layer's rows before the new one: [L]
            torch.sub(position, self._offsets_on_device, out=self._rows_at)
        h = embed(model, self._inputs.token) if hidden is None else hidden  # [1, H]
        softcap = cfg.arch.attn_softcap or 0.0
        for layer, slots in enumerate(self.layers):
            with stage("attention", device):
                q, k, v = project_qkv_with_rope(model, layer, h, *rope(model, layer))
                attn = self._kernels.attention(
                    q,
                    k,
                    v,
                    slots.data,
                    self._rows_at[layer : layer + 1] if shifted else position,
                    self._tables,
                    cfg.attn_scale,
                    softcap,
                    self._workspace,
                    self.levers[layer],
                    self._metas[layer],
                    use_cuda_partial=self.partial_in_cuda,
                )  # [Hq, 1, D]; the state now holds the new row
                h = attention_output(model, layer, h, attn.reshape(1, cfg.q_dim))
            with stage("ffn", device):
                h = ffn_block(model, layer, h, ffn)
        return h

    def _levers(
        self, where: LayerLayout, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> ModuleType:
        f32 = {"dtype": torch.float32, "device": device}
        ring_rows = ring_slots(where.recent)
        exact_rows = where.sinks + (0 if self._ring8 or not where.recent else ring_rows)
        ring = ring_scales = None
        if self._ring8:
            ring = torch.zeros((ring_rows, 2, kv_heads, dim), dtype=torch.int8, device=device)
            ring_scales = torch.zeros((ring_rows, 2, kv_heads), dtype=torch.float16, device=device)
        return self._kernels.Levers(
            exact=torch.zeros((max(1, exact_rows), 2, kv_heads, dim), dtype=dtype, device=device),
            ring=ring,
            ring_scales=ring_scales,
            mean=torch.zeros((2, kv_heads, dim), **f32),
            mean_rotated=torch.zeros((2, kv_heads, self._tables.rotated_dim), **f32),
            sinks=where.sinks,
            recent=where.recent,
            keep=self._kernels.FULL_LAYER_KEEP if where.keep is None else where.keep,
            center=self._center,
        )

    def _reserve(self, model: Model, capacity: int) -> None:
        """Room for `capacity` rows in each full layer; a sliding layer's ring slots (all of
        them at once where the path is shifted: its rows, every token's, outrun the capacity)."""
        shifted = self.shifted
        for slots, meta in zip(self.layers, self._metas, strict=True):
            slots.reserve(capacity if slots.keep is None or not shifted else slots.keep)
            meta.copy_(self._kernels.single_meta(slots.data))
        self._batch_rows = None
        reserve_rope(model, capacity + max(self._offsets))  # positions run ahead of the rows
        self._capacity = capacity
        self._graph.invalidate()


def layer_layout(layout: KvLayout, keep: int | None) -> LayerLayout:
    """A layer's sinks and recent rows: a sliding layer keeps no sinks and at most `keep`
    recent rows (as `QuantisedLayer` does)."""
    if keep is None:
        return LayerLayout(layout.sinks, layout.recent, None)
    return LayerLayout(0, min(layout.recent, keep), keep)
