"""The pure comparison metrics of the accuracy harness, beside KL: how far an engine's hidden
states and next-token distributions are from the reference's, and how its tokens agree.

Distributions are compared from logits (float64 softmax); hidden rows are the engines'
pre-final-norm outputs [H]."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """cos(a, b) in float64; 0 where either vector is zero."""
    a, b = a.double().flatten(), b.double().flatten()
    norms = float(a.norm() * b.norm())
    return float(a @ b) / norms if norms > 0 else 0.0


def mse(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean squared difference of a and b (float64)."""
    return float(((a.double() - b.double()) ** 2).mean())


def js_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Jensen–Shannon divergence in nats, (KL(P‖M) + KL(Q‖M)) / 2 with M = (P + Q) / 2, from
    logits [V]: symmetric and at most ln 2."""
    p = torch.softmax(p_logits.double(), dim=-1)
    q = torch.softmax(q_logits.double(), dim=-1)
    m = (p + q) / 2

    def kl(x: torch.Tensor) -> float:
        mask = x > 0
        return float((x[mask] * (x[mask] / m[mask]).log()).sum())

    return max((kl(p) + kl(q)) / 2, 0.0)


def top_k_overlap(p_logits: torch.Tensor, q_logits: torch.Tensor, k: int = 5) -> float:
    """|top-k(P) ∩ top-k(Q)| / k."""
    k = min(k, p_logits.shape[-1])
    ours = set(torch.topk(q_logits, k).indices.tolist())
    return len(ours.intersection(torch.topk(p_logits, k).indices.tolist())) / k


def reciprocal_rank(token: int, logits: torch.Tensor) -> float:
    """1 / rank of `token` under `logits` (rank 1: the most likely; ties count in its favour)."""
    return 1.0 / (1 + int((logits > logits[token]).sum()))


def token_match_rate(a: Sequence[int], b: Sequence[int]) -> float:
    """The fraction of positions where two token sequences agree, over the shorter length."""
    n = min(len(a), len(b))
    return sum(x == y for x, y in zip(a[:n], b[:n], strict=True)) / n if n else 1.0


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where the sequences differ (None: never, over the shorter length)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
