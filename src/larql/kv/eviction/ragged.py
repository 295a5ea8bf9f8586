"""`RaggedRows`: one layer's K/V where each K/V head keeps its own number of rows
(`heads=adaptive`). The rows are packed head-major, keys and values [N, D] with offsets
[Hkv + 1] (head h holds rows offsets[h]..offsets[h+1]), so the layer holds exactly the rows its
heads kept — no padding to the widest head. The rows decoded after the prompt, one per head per
step, go to a `KvBuffer` beside them (`tail`) until a policy that evicts as it decodes folds them
in (`merge`). A policy that scores rows as it decodes keeps a score per packed row [N] float32.

Attention of one decode query reads every packed row for every head and masks the other heads'
rows: Hkv times the products of a per-head loop over the packed part (the packed rows are read
once, as one matrix), with no Python-side count of a head's rows — so it runs on any device,
the meta device of `larql memory` included.
"""

from __future__ import annotations

import torch

from larql.inference.memory import tensor_bytes
from larql.inference.snapshots import SnapshotCorrupt, StateReader, StateWriter
from larql.kv.buffers import KvBuffer
from larql.models.model import Model


class RaggedRows:
    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        offsets: torch.Tensor,
        score: torch.Tensor | None = None,
    ) -> None:
        self.keys, self.values = keys, values  # [N, D] each, head-major, position order
        self.offsets = offsets  # [Hkv + 1] int64
        self.score = score  # [N] float32 or None
        self.tail = KvBuffer()  # decoded rows [Hkv, m, D]
        self.weights: tuple[torch.Tensor, torch.Tensor] | None = None  # the last `attend`'s

    @classmethod
    def picked(
        cls,
        k: torch.Tensor,
        v: torch.Tensor,
        head: torch.Tensor,
        position: torch.Tensor,
        score: torch.Tensor | None = None,
    ) -> RaggedRows:
        """The rows (head[i], position[i]) of k, v [Hkv, T, D], head-major (`Budget.adaptive`);
        `score` [Hkv, T]: each kept row's score is carried."""
        heads = k.shape[0]
        counts = (head[None, :] == torch.arange(heads, device=k.device)[:, None]).sum(dim=1)
        offsets = torch.cat((counts.new_zeros(1), counts.cumsum(0)))  # [Hkv + 1]
        kept = None if score is None else score[head, position].float()
        return cls(k[head, position], v[head, position], offsets, kept)

    @property
    def heads(self) -> int:
        return self.offsets.shape[0] - 1

    def __len__(self) -> int:
        """Rows per head, on average (the packed rows over the heads, and the decoded rows)."""
        return self.keys.shape[0] // self.heads + len(self.tail)

    def counts(self) -> list[int]:
        """Each head's rows, the decoded ones included."""
        return [int(n) + len(self.tail) for n in self.offsets.diff().tolist()]

    def own_rows(self) -> torch.Tensor:
        """[Hkv, N] bool: packed row n belongs to head h."""
        n = torch.arange(self.keys.shape[0], device=self.keys.device)
        return (n[None, :] >= self.offsets[:-1, None]) & (n[None, :] < self.offsets[1:, None])

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """A decode step's row of every head, k, v [Hkv, 1, D]."""
        self.tail.append(k, v)

    def attend(self, model: Model, layer: int, q: torch.Tensor) -> torch.Tensor:
        """One decode query q [Hq, 1, D] over each head's own rows → output [1, Hq·D]; its
        weights per K/V head, summed over the query group, stay in `weights`: (packed [N],
        decoded [Hkv, m]) float32."""
        cfg = model.config
        hq, _, dim = q.shape
        heads = self.heads
        wide = torch.promote_types(q.dtype, torch.float32)
        grouped = q.reshape(heads, hq // heads, dim).to(wide)  # [Hkv, G, D]
        packed = torch.einsum("hgd,nd->hgn", grouped, self.keys.to(wide))  # [Hkv, G, N]
        if len(self.tail):
            tail_k, tail_v = self.tail.keys.to(wide), self.tail.values.to(wide)  # [Hkv, m, D]
        else:
            tail_k = tail_v = grouped.new_zeros(heads, 0, dim)
        decoded = torch.einsum("hgd,hmd->hgm", grouped, tail_k)  # [Hkv, G, m]
        scores = torch.cat((packed, decoded), dim=-1) * cfg.attn_scale
        if cfg.arch.attn_softcap is not None:
            cap = cfg.arch.attn_softcap
            scores = cap * torch.tanh(scores / cap)
        n = self.keys.shape[0]
        scores[..., :n] = scores[..., :n].masked_fill(~self.own_rows()[:, None, :], float("-inf"))
        sinks = model.weights.layers[layer].attn_sinks
        if sinks is not None:  # a logit per query head whose weight goes to no value
            sink = sinks.to(wide).view(heads, hq // heads, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)  # [Hkv, G, N + m]
        out = probs[..., :n] @ self.values.to(wide) + probs[..., n:] @ tail_v  # [Hkv, G, D]
        mass = probs.sum(dim=1)  # [Hkv, N + m]
        own = mass[:, :n].sum(dim=0)  # other heads' rows weigh 0: [N]
        self.weights = (own.float(), mass[:, n:].float())
        return out.to(q.dtype).reshape(1, hq * dim)

    def merge(self, tail_score: torch.Tensor | None = None) -> None:
        """Fold the decoded rows into the packed ones, each at the end of its head's rows
        (`tail_score` [Hkv, m]: their scores, else 0)."""
        m = len(self.tail)
        if m == 0:
            return
        heads, device = self.heads, self.keys.device
        counts = self.offsets.diff()  # [Hkv]
        # each packed row moves down by the decoded rows of the heads before its own
        head_of = torch.repeat_interleave(
            torch.arange(heads, device=device), counts, output_size=self.keys.shape[0]
        )
        packed_to = torch.arange(self.keys.shape[0], device=device) + head_of * m  # [N]
        tail_to = self.offsets[1:, None] + m * torch.arange(1, heads + 1, device=device)[:, None]
        tail_to = tail_to - m + torch.arange(m, device=device)[None, :]  # [Hkv, m]
        total = self.keys.shape[0] + heads * m
        order = torch.cat((packed_to, tail_to.reshape(-1)))  # destination of each source row
        self.keys = _placed(self.keys, self.tail.keys.reshape(-1, self.keys.shape[1]), order, total)
        self.values = _placed(
            self.values, self.tail.values.reshape(-1, self.values.shape[1]), order, total
        )
        if self.score is not None:
            fresh = (
                tail_score.reshape(-1)
                if tail_score is not None
                else self.score.new_zeros(heads * m)
            )
            self.score = _placed(self.score[:, None], fresh[:, None], order, total)[:, 0]
        self.offsets = self.offsets + m * torch.arange(heads + 1, device=device)
        self.tail = KvBuffer()

    def keep(self, head: torch.Tensor, index: torch.Tensor) -> None:
        """Keep the packed rows `index` [N'] (in order), head[i] the head of index[i]."""
        counts = (head[None, :] == torch.arange(self.heads, device=head.device)[:, None]).sum(1)
        self.offsets = torch.cat((counts.new_zeros(1), counts.cumsum(0)))
        self.keys, self.values = self.keys[index], self.values[index]
        if self.score is not None:
            self.score = self.score[index]

    def head_of_rows(self) -> torch.Tensor:
        """[N] each packed row's head."""
        return torch.repeat_interleave(
            torch.arange(self.heads, device=self.keys.device),
            self.offsets.diff(),
            output_size=self.keys.shape[0],
        )

    def live_nbytes(self) -> int:
        return (
            tensor_bytes(self.keys, self.values, self.offsets, self.score) + self.tail.live_nbytes()
        )

    def nbytes(self) -> int:
        return tensor_bytes(self.keys, self.values, self.offsets, self.score) + self.tail.nbytes()

    def write_state(self, state: StateWriter) -> None:
        state.tensor("offsets", self.offsets)  # [Hkv + 1] int64: head h's rows
        state.tensor("k", self.keys)  # [N, D]
        state.tensor("v", self.values)
        state.tensor("score", self.score)  # [N] float32, where the policy scores as it decodes
        self.tail.write_state(state.scope("tail"))

    @classmethod
    def read_state(
        cls,
        state: StateReader,
        position: int,
        dtype: torch.dtype,
        heads: int,
        dim: int,
        scored: bool,
    ) -> RaggedRows:
        """What `write_state` wrote after `position` tokens: each head's packed rows at most
        `position`, decoded rows at most `position`."""
        offsets = state.tensor("offsets", torch.int64, (heads + 1,))
        steps = offsets.diff()
        if int(offsets[0]) != 0 or bool((steps < 0).any()) or bool((steps > position).any()):
            raise SnapshotCorrupt(
                f"state tensor {state.prefix}offsets is not 0 then {heads} head row counts "
                f"of at most {position} each"
            )
        total = int(offsets[-1])
        keys = state.tensor("k", dtype, (total, dim))
        values = state.tensor("v", dtype, (total, dim))
        score = state.tensor("score", torch.float32, (total,)) if scored else None
        rows = cls(keys, values, offsets.to(keys.device), score)
        tail = state.scope("tail")
        count = tail.row_count("k", 0, position)
        rows.tail.read_state(tail, count, dtype, heads, dim)
        return rows


def _placed(
    first: torch.Tensor, second: torch.Tensor, order: torch.Tensor, total: int
) -> torch.Tensor:
    """Rows of first [N, D] then second [M, D] put at rows `order` [N + M] of a new [total, D]."""
    out = first.new_empty(total, first.shape[1])
    out[order] = torch.cat((first, second))
    return out
