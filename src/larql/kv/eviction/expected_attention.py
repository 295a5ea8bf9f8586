"""`expected-attention`: score each prompt row by the attention the queries still to come are
expected to give it, estimated from the statistics of the prompt's last queries.

Per query head, the last `queries` prompt queries are taken back to before their rotary
embedding (the inverse rotation at their positions) and summarised by their mean μ and
covariance Σ [D, D]. A query at a future position p is R(p)·q, and a cached key k is already
rotated at its own position, so its logit is (R(p)q)·k·s (s: the attention scale). Averaging
the rotation over the next `future` positions, R̄ = mean_p R(p) (per frequency pair: the mean
cos and sin), the future query is modelled as Gaussian with mean μ̄ = R̄μ and covariance
Σ̄ = R̄ΣR̄ᵀ, and the expected unnormalised weight of row k is

    E[exp(s·q·k)] = exp(s·μ̄·k + s²·kᵀΣ̄k / 2),

normalised over the rows into an expected attention distribution (a softmax of those
exponents), then — with `vnorm=1` — weighted by ‖v‖ (a row's contribution to the output is its
weight times its value), and averaged over the query heads sharing the K/V head.

Query-agnostic by default: the statistics are the context's own last queries. With the question
at the end of the prompt (inside the last `queries` positions) they are the question's, which
makes it query-aware; `queries` small (a question's length) leans on them alone."""

from __future__ import annotations

import torch

from larql.inference.layer import rope_table
from larql.inference.rope import apply_rope
from larql.kv.eviction.budget import Budget
from larql.kv.eviction.scoring import ScoringEngine
from larql.models.model import Model


class ExpectedAttentionEngine(ScoringEngine):
    name = "expected-attention"

    def __init__(
        self,
        budget: Budget,
        queries: int = 128,
        future: int = 512,
        vnorm: bool = True,
        profiling: bool = False,
    ) -> None:
        super().__init__(budget, profiling)
        self.queries, self.future, self.vnorm = queries, future, vnorm

    def scorer(self) -> str:
        return (
            f"the rows the next {self.future} positions' queries are expected to attend to "
            f"(statistics of the last {self.queries} queries"
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
    ) -> torch.Tensor:
        """The last `queries` queries so far before their rotation [Hq, ≤ queries, D]."""
        cos, sin = rope_table(model, layer).slice(start, q.shape[1])
        plain = apply_rope(q, cos, -sin)  # R(−θ): the inverse rotation
        last = plain if held is None else torch.cat((held, plain), dim=1)  # type: ignore[arg-type]
        return last[:, -self.queries :]

    def _row_scores(
        self, model: Model, layer: int, held: object, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        assert isinstance(held, torch.Tensor)
        kv_heads, t, dim = k.shape
        wide = torch.promote_types(k.dtype, torch.float32)
        plain = held.to(wide)  # [Hq, n, D]
        mean = plain.mean(dim=1, keepdim=True)  # [Hq, 1, D]
        centred = plain - mean
        cov = centred.transpose(1, 2) @ centred / max(plain.shape[1], 1)  # [Hq, D, D]
        cos, sin = rope_table(model, layer).slice(t, self.future)
        cos = cos.to(wide).mean(dim=0, keepdim=True)  # [1, rotary]: R̄ per frequency pair
        sin = sin.to(wide).mean(dim=0, keepdim=True)
        future_mean = apply_rope(mean, cos, sin)  # R̄μ [Hq, 1, D]
        future_cov = apply_rope(apply_rope(cov, cos, sin).transpose(1, 2), cos, sin)  # R̄ΣR̄ᵀ
        group = plain.shape[0] // kv_heads
        keys = k.to(wide)
        scale = model.config.attn_scale
        mu = future_mean.reshape(kv_heads, group, dim)  # [Hkv, G, D]
        sigma = future_cov.reshape(kv_heads, group, dim, dim)  # [Hkv, G, D, D]
        linear = torch.einsum("hgd,htd->hgt", mu, keys) * scale  # [Hkv, G, T]
        spread = torch.einsum("htd,hgde,hte->hgt", keys, sigma, keys) * (scale * scale / 2)
        expected = torch.softmax(linear + spread, dim=-1)  # [Hkv, G, T]
        if self.vnorm:
            expected = expected * v.to(wide).norm(dim=-1)[:, None, :]
        return expected.mean(dim=1).float()  # [Hkv, T]
