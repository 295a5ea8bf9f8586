"""turbo-quant's decode step where the Triton kernels run (CUDA): the packed codes in fixed
slots, two launches per layer for attention and encoding, the whole step captured in a CUDA
graph.

Each layer's codes live in a `CodeSlots` buffer, uint8 [slots, row_bytes], token t in slot
t mod slots: on a full-attention layer slots is the capacity (≥ every position; it doubles when
the position reaches it, and the graph is captured again), on a sliding layer the window − 1 rows
a later query can still see (a ring; smaller while the capacity is). The step reads its token
and position from device tensors (`StepInputs`), so `kernels.attention`
attends over the filled slots and writes the new row into its slot inside the graph: no host
sync, no allocation, one replay per token. The bytes held are the codec's, as on the torch path;
the slots not yet filled are the growth reserve.
"""

from __future__ import annotations

from types import ModuleType

import torch

from larql.inference.ffn import FfnBackend
from larql.inference.layer import (
    attention_output,
    embed,
    ffn_block,
    project_qkv_with_rope,
)
from larql.inference.memory import MemoryBreakdown
from larql.inference.profiling import EngineProfiler
from larql.kv.captured_step import (
    CapturedStep,
    RopeAtPosition,
    StepInputs,
    initial_capacity,
    reserve_rope,
)
from larql.kv.turbo_quant.codec import TurboQuantCodec
from larql.kv.turbo_quant.layout import token_vectors
from larql.models.model import Model


class CodeSlots:
    """One layer's encoded rows: uint8 [slots, row_bytes], token t in slot t mod slots.
    `keep`: the rows a sliding layer retains (None: every row)."""

    def __init__(self, keep: int | None, row_bytes: int, device: torch.device) -> None:
        self.keep = keep
        self.row_bytes = row_bytes
        self.device = device
        self.data = torch.zeros((0, row_bytes), dtype=torch.uint8, device=device)
        self.filled = 0  # slots holding a row

    @property
    def slots(self) -> int:
        return self.data.shape[0]

    def nbytes(self) -> int:
        return self.data.numel()

    def live_nbytes(self) -> int:
        return self.filled * self.row_bytes

    def reserve(self, capacity: int) -> None:
        """Room for positions < capacity: `capacity` slots, or `keep` on a sliding layer.
        Called only while no row has wrapped (every filled slot t holds token t)."""
        slots = capacity if self.keep is None else min(self.keep, capacity)
        if slots == self.slots:
            return
        data = torch.zeros((slots, self.row_bytes), dtype=torch.uint8, device=self.device)
        data[: self.filled] = self.data[: self.filled]
        self.data = data

    def write_prompt(self, rows: torch.Tensor) -> None:
        """rows: [S, row_bytes], tokens 0..S−1 → the last `slots` of them, each in its slot."""
        s = rows.shape[0]
        kept = min(s, self.slots)
        tokens = torch.arange(s - kept, s, device=self.device)
        self.data.index_copy_(0, tokens % self.slots, rows[s - kept :])
        self.filled = kept

    def in_token_order(self, position: int) -> torch.Tensor:
        """The filled slots as rows of tokens position − filled … position − 1, oldest first:
        uint8 [filled, row_bytes] (`position` = the next token's)."""
        tokens = torch.arange(position - self.filled, position, device=self.device)
        return self.data.index_select(0, tokens % self.slots)

    def advance(self) -> None:
        """One more row written by the step."""
        self.filled = min(self.filled + 1, self.slots)


class KernelPath:
    """The decode state and step of a `TurboQuantEngine` on the Triton kernels."""

    def __init__(
        self,
        kernels: ModuleType,
        codec: TurboQuantCodec,
        model: Model,
        keeps: list[int | None],
        use_graph: bool,
        profiler: EngineProfiler,
    ) -> None:
        self._kernels = kernels
        self._tables = kernels.CodecTables.of(codec, model.device)
        cfg = model.config
        self._workspace = kernels.Workspace.of(
            cfg.num_heads, cfg.num_kv_heads, self._tables, model.device
        )
        row_bytes = 2 * cfg.num_kv_heads * codec.bytes_per_vector
        self.layers = [CodeSlots(keep, row_bytes, model.device) for keep in keeps]
        self._inputs = StepInputs(model.device)
        self._graph = CapturedStep()
        self._use_graph = use_graph and not profiler.enabled  # the graph has no stages
        self._profiler = profiler
        self._capacity = 0

    @staticmethod
    def supports(kernels: ModuleType, codec: object, keeps: list[int | None]) -> bool:
        """The kernels handle this codec, and every sliding layer keeps at least one row."""
        if not isinstance(codec, TurboQuantCodec) or not kernels.supports(codec):
            return False
        return all(keep is None or keep > 0 for keep in keeps)

    @property
    def captured(self) -> bool:
        return self._graph.captured

    def memory(self) -> MemoryBreakdown:
        return MemoryBreakdown.of(hot=self.layers)

    def start(self, model: Model, prompt_length: int) -> None:
        self._reserve(model, initial_capacity(prompt_length))

    def store_prompt(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [Hkv, S, D], the prompt's exact rows → encoded into the layer's slots."""
        s = k.shape[1]
        vectors = token_vectors(k, v)  # [S·2·Hkv, D]
        encoded = self._kernels.encode(vectors, self._tables)  # [S·2·Hkv, bytes_per_vector]
        self.layers[layer].write_prompt(encoded.view(s, -1))  # [S, row_bytes]

    def decode(
        self,
        model: Model,
        ffn: FfnBackend,
        position: int,
        token_id: int = 0,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The token `token_id` (or the residual row `hidden` [1, H]) at `position` through every
        layer, its K/V encoded into the slots. → hidden [1, H]"""
        if position >= self._capacity:
            self._reserve(model, self._capacity * 2)
        self._inputs.set(token_id, position)
        if hidden is not None:
            out = self._step(model, ffn, hidden)
        elif self._use_graph and self._graph.ready(
            model, ffn, lambda: self._step(model, ffn), preserve=[s.data for s in self.layers]
        ):
            out = self._graph.replay()
        else:
            out = self._step(model, ffn)
        for slots in self.layers:
            slots.advance()
        return out

    def _step(
        self, model: Model, ffn: FfnBackend, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Every layer at the position in `self._inputs`, every shape static. → hidden [1, H]"""
        cfg = model.config
        stage, device = self._profiler.stage, model.device
        position = self._inputs.position
        rope = RopeAtPosition(position)
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
                    position,
                    self._tables,
                    cfg.attn_scale,
                    softcap,
                    self._workspace,
                )  # [Hq, 1, D]; the new row is now in its slot
                h = attention_output(model, layer, h, attn.reshape(1, cfg.q_dim))
            with stage("ffn", device):
                h = ffn_block(model, layer, h, ffn)
        return h

    def _reserve(self, model: Model, capacity: int) -> None:
        for slots in self.layers:
            slots.reserve(capacity)
        reserve_rope(model, capacity)
        self._capacity = capacity
        self._graph.invalidate()
