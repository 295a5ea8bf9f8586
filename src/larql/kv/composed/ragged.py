"""`RaggedCodes`: one layer's kept rows in a quantiser's store when each K/V head keeps its own
count of them (`heads=adaptive` composed with a quantiser).

Each head's kept prompt rows are a store of their own (one K/V head, its own sinks, centre and
codes), so the layer codes exactly the rows its heads kept — no padding to the widest head —
and the rows decoded after the prompt, one per head per step, go to one more store of every
head (`tail`). A decode query decodes the stores into the quantiser's attention basis, packs
the prompt rows head-major (`RaggedRows`' layout: offsets [Hkv + 1]) and attends each head's
own rows there (`RaggedRows.attend`), in the codec's rotated basis where the quantiser attends
in it. This is the quantiser's torch path (the codes decoded each step), on any device.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import torch

from larql.inference.memory import MemoryBreakdown, tensor_bytes
from larql.inference.snapshots import StateReader, StateWriter
from larql.kv.composed.dropping import drop_rows
from larql.kv.eviction.ragged import RaggedRows
from larql.kv.turbo_quant.store import QuantisedLayer, rotate
from larql.models.model import Model

# a new, empty store of `heads` K/V heads in the quantiser's layout for the layer; its
# `write_state` writes its row count as `rows` first (`KeptCodes`)
StoreMaker = Callable[[int], QuantisedLayer]


class RaggedCodes:
    def __init__(
        self,
        heads: list[QuantisedLayer],
        tail: QuantisedLayer,
        score: torch.Tensor | None = None,
    ) -> None:
        self.heads = heads  # per K/V head: its kept prompt rows, [1, n_h, D] coded
        self.tail = tail  # the decoded rows of every head, [Hkv, m, D] coded
        # a policy that evicts as it decodes: each packed row's score [N] float32 (head-major);
        # the decoded rows then go to their head's own store (`tail` stays empty) and the
        # last step's weights stay in `weights` (packed [N], decoded [Hkv, 1])
        self.score = score
        self.weights: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def held(cls, rows: RaggedRows, make: StoreMaker) -> RaggedCodes:
        """The policy's packed rows (keys, values [N, D], offsets [Hkv + 1]) coded per head."""
        heads = []
        bounds = rows.offsets.tolist()
        for start, end in pairwise(bounds):
            store = make(1)
            if end > start:
                store.append(rows.keys[None, start:end], rows.values[None, start:end])
            heads.append(store)
        tail = _tail(make, rows.heads)
        means = [store.mean for store in heads]
        if all(mean is not None for mean in means):  # decoded rows centred on the prompt's
            tail.mean = torch.cat(means, dim=1)  # type: ignore[arg-type]  # [2, Hkv, D]
        if len(rows.tail):
            tail.append(rows.tail.keys, rows.tail.values)
        return cls(heads, tail, None if rows.score is None else rows.score.float())

    def __len__(self) -> int:
        """Rows per head, on average (as `RaggedRows` counts them)."""
        return sum(len(store) for store in self.heads) // len(self.heads) + len(self.tail)

    def counts(self) -> list[int]:
        """Each head's rows, the decoded ones included."""
        return [len(store) + len(self.tail) for store in self.heads]

    def _offsets(self, device: torch.device) -> torch.Tensor:
        counts = torch.tensor([len(store) for store in self.heads], device=device)
        return torch.cat((counts.new_zeros(1), counts.cumsum(0)))  # [Hkv + 1] int64

    # ------------------------------------------------------------------ dropping rows

    @property
    def offsets(self) -> torch.Tensor:
        """[Hkv + 1] int64: head h's rows are packed rows offsets[h]..offsets[h+1] (where the
        scores are, as `RaggedRows.offsets`)."""
        assert self.score is not None, "only a store that drops rows packs its scores"
        return self._offsets(self.score.device)

    def head_of_rows(self) -> torch.Tensor:
        """[N] each packed row's head."""
        assert self.score is not None
        counts = torch.tensor([len(store) for store in self.heads], device=self.score.device)
        heads = torch.arange(len(self.heads), device=self.score.device)
        return torch.repeat_interleave(heads, counts, output_size=self.score.shape[0])

    def merge(self, tail_score: torch.Tensor) -> None:
        """The decoded rows' scores tail_score [Hkv, m] put after their head's (`attend` put
        the rows themselves in each head's store already)."""
        assert self.score is not None
        m = tail_score.shape[1]
        before = [len(store) - m for store in self.heads]
        parts = self.score.split(before)
        self.score = torch.cat([t for h, part in enumerate(parts) for t in (part, tail_score[h])])

    def keep(self, head: torch.Tensor, index: torch.Tensor) -> None:
        """Keep the packed rows `index` [N'] (in order), head[i] the head of index[i]: each
        head's store compacted to its own (`drop_rows`)."""
        assert self.score is not None
        local = index - self.offsets[head]  # [N'] each row's index in its head's store
        for h, store in enumerate(self.heads):
            drop_rows(store, local[head == h][None, :])
        self.score = self.score[index]

    def memory(self) -> MemoryBreakdown:
        total = MemoryBreakdown()
        for store in (*self.heads, self.tail):
            total = total + store.memory()
        return total + MemoryBreakdown(hot=tensor_bytes(self.score))

    def nbytes(self) -> int:
        return self.memory().total

    def live_nbytes(self) -> int:
        return self.memory().state

    # ------------------------------------------------------------------ decode attention

    def attend(
        self,
        model: Model,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotation: torch.Tensor | None,
    ) -> torch.Tensor:
        """q [Hq, 1, D] over each head's held rows and the new row k, v [Hkv, 1, D] → [1, q_dim]
        (in the rotated basis `rotation` R [D', D'] gives, then back); the new row is then
        coded into `tail`."""
        dtype, device = model.dtype, q.device
        packed_k, packed_v = [], []
        for store in self.heads:
            if len(store):
                keys, values = store.keys_values(dtype, rotation)  # [1, n_h, D']
                packed_k.append(keys[0])
                packed_v.append(values[0])
        new_k, new_v = k, v
        if rotation is not None:
            new_k, new_v = rotate(k, rotation).to(dtype), rotate(v, rotation).to(dtype)
        width = new_k.shape[-1]
        empty = new_k.new_zeros(0, width)
        rows = RaggedRows(
            torch.cat(packed_k) if packed_k else empty,  # [N, D']
            torch.cat(packed_v) if packed_v else empty,
            self._offsets(device),
        )
        tail_k, tail_v = self.tail.keys_values(dtype, rotation)  # [Hkv, m, D']
        if tail_k.shape[1]:
            rows.append(tail_k.to(device), tail_v.to(device))
        rows.append(new_k, new_v)
        query = q if rotation is None else rotate(q, rotation).to(dtype)
        attn = rows.attend(model, layer, query)  # [1, Hq·D']
        if self.score is None:
            self.tail.append(k, v)  # the exact new row, coded as the quantiser codes it
        else:  # each head's row into its own store, where rows are dropped
            self.weights = rows.weights
            for h, store in enumerate(self.heads):
                store.append(k[h : h + 1], v[h : h + 1])
        if rotation is None:
            return attn
        cfg = model.config
        back = attn.view(cfg.num_heads, -1).float() @ rotation  # [Hq, D'] (R·R = I)
        return back[:, : cfg.head_dim_of(layer)].to(dtype).reshape(1, cfg.q_dim_of(layer))

    # ------------------------------------------------------------------ saved state

    def write_state(self, state: StateWriter) -> None:
        """`ragged.N.*` head N's store, `ragged.tail.*` the decoded rows' store (each its
        `rows` count, then `QuantisedLayer.write_state`); `ragged.score` [N] float32 where
        the policy drops rows."""
        scoped = state.scope("ragged")
        for h, store in enumerate(self.heads):
            store.write_state(scoped.scope(h))
        self.tail.write_state(scoped.scope("tail"))
        scoped.tensor("score", self.score)

    @classmethod
    def read_state(
        cls, state: StateReader, make: StoreMaker, kv_heads: int, most: int, scored: bool
    ) -> RaggedCodes:
        """What `write_state` wrote after `most` tokens: each store at most `most` rows (with
        the packed rows' scores where `scored`)."""
        scoped = state.scope("ragged")
        heads = []
        for h in range(kv_heads):
            store = make(1)
            store.read_state(scoped.scope(h), scoped.scope(h).integer("rows", 0, most))
            heads.append(store)
        part = scoped.scope("tail")
        tail = _tail(make, kv_heads)
        count = part.integer("rows", 0, most)
        tail.read_state(part, count)
        means = [store.mean for store in heads]
        if count == 0 and tail.layout.center and all(mean is not None for mean in means):
            # `held` gave the tail the heads' means before any row (read back only with rows)
            tail.mean = part.tensor("mean", torch.float32, (2, kv_heads, tail.layout.k_codec.dim))
        total = sum(len(store) for store in heads)
        score = scoped.tensor("score", torch.float32, (total,)) if scored else None
        return cls(heads, tail, score)


def _tail(make: StoreMaker, kv_heads: int) -> QuantisedLayer:
    """The store of the decoded rows: no sinks (the prompt's first rows are the sinks), as the
    quantiser alone codes the rows after them."""
    tail = make(kv_heads)
    tail.sink_room = 0
    return tail
