"""`expected-attention`: score each prompt row by the attention the queries still to come are
expected to give it, estimated from the statistics of the prompt's queries (Devoto et al.,
"Expected Attention", the method of kvpress's `ExpectedAttentionPress`).

Per query head, the prompt's queries after its first `sinks` positions (`queries=N`: only the
last N of them) are taken back to before their rotary embedding (the inverse rotation at their
positions) and summarised by their mean μ and covariance Σ [D, D] (divided by their count). A
query at a future position p is R(p)·q, and a cached key k is already rotated at its own
position, so its logit is (R(p)q)·k·s (s: the attention scale). Averaging the rotation over the
next `future` positions, R̄ = mean_p R(p), the future query is modelled as Gaussian with mean
μ̄ = R̄μ and covariance Σ̄ = R̄ΣR̄ᵀ, and the expected unnormalised weight of row k is

    E[exp(s·q·k)] = exp(s·μ̄·k + s²·kᵀΣ̄k / 2).

The sink rows are set aside (always kept, scored as the best row): per query head a softmax of
those exponents over the other rows gives an expected attention distribution, the heads sharing
the K/V head are averaged, and — with `vnorm=1` — each row is weighted by ‖v‖ (its contribution
to the output is its weight times its value).

Query-agnostic by default: the statistics are the context's own queries. With the question at
the end of the prompt, `queries` of about its length makes them the question's (query-aware).

The statistics of every query are kept as running moments (count, mean, centred sum of
products), merged part by part, so a long prompt or one taken in parts costs Hq·D² per layer,
not a row per query."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from larql.inference.layer import rope_table
from larql.inference.rope import apply_rope
from larql.kv.eviction.budget import Budget
from larql.kv.eviction.scoring import ScoringEngine
from larql.models.model import Model


@dataclass(frozen=True)
class Moments:
    """Running statistics of the queries seen: count, mean [Hq, 1, D], centred Σ qqᵀ [Hq, D, D]."""

    count: int
    mean: torch.Tensor
    products: torch.Tensor

    @classmethod
    def of(cls, rows: torch.Tensor) -> Moments:
        """rows [Hq, n, D] (n ≥ 1) → their moments."""
        mean = rows.mean(dim=1, keepdim=True)
        centred = rows - mean
        return cls(rows.shape[1], mean, centred.transpose(1, 2) @ centred)

    def merged(self, other: Moments) -> Moments:
        """The moments of both sets (the pairwise update: no Σ qqᵀ − nμμᵀ cancellation)."""
        count = self.count + other.count
        delta = other.mean - self.mean  # [Hq, 1, D]
        mean = self.mean + delta * (other.count / count)
        spread = delta.transpose(1, 2) @ delta * (self.count * other.count / count)
        return Moments(count, mean, self.products + other.products + spread)

    def covariance(self) -> torch.Tensor:
        return self.products / self.count


class ExpectedAttentionEngine(ScoringEngine):
    name = "expected-attention"

    def __init__(
        self,
        budget: Budget,
        queries: int = 0,
        future: int = 512,
        vnorm: bool = True,
        profiling: bool = False,
    ) -> None:
        super().__init__(budget, profiling)
        self.queries, self.future, self.vnorm = queries, future, vnorm

    def scorer(self) -> str:
        which = f"the last {self.queries}" if self.queries else "every"
        return (
            f"the rows the next {self.future} positions' queries are expected to attend to "
            f"(statistics of {which} prompt query after the sinks"
            + (", weighted by ‖v‖)" if self.vnorm else ")")
        )

    def scorer_config(self) -> str:
        return f"queries={self.queries},future={self.future},vnorm={int(self.vnorm)}"

    def _observe(
        self,
        model: Model,
        layer: int,
        held: object,
        q: torch.Tensor,
        start: int,
        keys: torch.Tensor,
    ) -> object:
        """The queries so far after the sinks, before their rotation: their moments, or (with
        `queries=N`) the last N of them [Hq, ≤ N, D]."""
        cos, sin = rope_table(model, layer).slice(start, q.shape[1])
        plain = apply_rope(q, cos, -sin)  # R(−θ): the inverse rotation
        plain = plain[:, max(0, self.budget.sinks - start) :]
        plain = plain.to(torch.promote_types(plain.dtype, torch.float32))
        if self.queries:
            last = plain if held is None else torch.cat((held, plain), dim=1)  # type: ignore[arg-type]
            return last[:, -self.queries :]
        if plain.shape[1] == 0:
            return held
        part = Moments.of(plain)
        return part if held is None else held.merged(part)  # type: ignore[union-attr]

    def _statistics(self, held: object) -> tuple[torch.Tensor, torch.Tensor] | None:
        """μ [Hq, 1, D] and Σ [Hq, D, D] of what `_observe` kept; None if no query was kept."""
        if isinstance(held, Moments):
            return held.mean, held.covariance()
        if isinstance(held, torch.Tensor) and held.shape[1] > 0:
            moments = Moments.of(held)
            return moments.mean, moments.covariance()
        return None

    def _mean_rotation(self, model: Model, layer: int, start: int, dim: int) -> torch.Tensor:
        """R̄ [D, D]: the rotary rotation averaged over positions start..start+future−1."""
        cos, sin = rope_table(model, layer).slice(start, self.future)
        cos, sin = cos.to(torch.float64).mean(dim=0), sin.to(torch.float64).mean(dim=0)
        rotary = cos.shape[0]  # `RopeTable` rows: [cos, cos] and the signed [−sin, sin]
        pair = (torch.arange(rotary, device=cos.device) + rotary // 2) % rotary
        matrix = torch.eye(dim, dtype=torch.float64, device=cos.device)
        index = torch.arange(rotary, device=cos.device)
        matrix[index, index] = cos
        matrix[index, pair] = sin  # (R̄x)_i = c_i·x_i ± s_i·x_(i ± half)
        return matrix

    def _row_scores(
        self, model: Model, layer: int, held: object, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        kv_heads, t, dim = k.shape
        sinks = min(self.budget.sinks, t)
        statistics = self._statistics(held)
        if statistics is None or sinks == t:
            return torch.ones(kv_heads, t, device=k.device)
        mean, cov = statistics
        wide = mean.dtype
        rotation = self._mean_rotation(model, layer, t, dim).to(wide)
        future_mean = mean @ rotation.T  # R̄μ [Hq, 1, D]
        future_cov = rotation @ cov @ rotation.T  # R̄ΣR̄ᵀ [Hq, D, D]
        group = mean.shape[0] // kv_heads
        keys = k[:, sinks:].to(wide)  # the sinks are kept and take no share of the softmax
        scale = model.config.attn_scale
        mu = future_mean.reshape(kv_heads, group, dim)  # [Hkv, G, D]
        sigma = future_cov.reshape(kv_heads, group, dim, dim)  # [Hkv, G, D, D]
        linear = torch.einsum("hgd,htd->hgt", mu, keys) * scale  # [Hkv, G, T − sinks]
        spread = torch.einsum("htd,hgde,hte->hgt", keys, sigma, keys) * (scale * scale / 2)
        expected = torch.softmax(linear + spread, dim=-1).mean(dim=1)  # [Hkv, T − sinks]
        if self.vnorm:
            expected = expected * v[:, sinks:].to(wide).norm(dim=-1)
        best = expected.amax(dim=-1, keepdim=True).expand(kv_heads, sinks)
        return torch.cat((best, expected), dim=-1).float()  # [Hkv, T]
