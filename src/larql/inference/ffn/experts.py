"""A mixture-of-experts block: the router picks each token's top-k experts and the block returns
their gated MLP outputs weighed by the routing, plus the shared expert where there is one.

Two ways to run the same arithmetic: with few (token, expert) pairs — a decode step — every pair
gathers its expert's matrices (static shapes, no host sync: a CUDA graph can capture it, and it
reads only the chosen experts); with many — a prefill — each expert that was chosen runs once
over all the tokens that chose it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from larql.models.config import ExpertRouting
from larql.models.weights import ExpertWeights

Activation = Callable[[torch.Tensor], torch.Tensor]


def route(logits: torch.Tensor, routing: ExpertRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [S, E] → (weights [S, k] float32, expert indices [S, k]): softmax over
    every expert, the top k, renormalised to sum to 1 where the architecture does."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, chosen = probs.topk(routing.top_k, dim=-1)
    if routing.normalize_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def experts_forward(
    experts: ExpertWeights, routing: ExpertRouting, x: torch.Tensor, act: Activation
) -> torch.Tensor:
    """x: [S, H] pre-FFN-normed → the block's output [S, H]."""
    weights, chosen = route(F.linear(x, experts.router), routing)  # [S, k] each
    weights = weights.to(x.dtype)
    if chosen.numel() <= experts.router.shape[0]:
        out = _gathered(experts, x, weights, chosen, act)
    else:
        out = _per_expert(experts, x, weights, chosen, act)
    shared = shared_output(experts, x, act)  # [S, H] or None
    return out if shared is None else out + shared


def expert_output(
    experts: ExpertWeights, expert: int, x: torch.Tensor, act: Activation
) -> torch.Tensor:
    """One expert's MLP of rows x [N, H], not weighted by the routing → [N, H] (what a remote
    expert shard computes)."""
    return _mlp(x, experts.gate_up[expert], experts.down[expert], act)


def shared_output(experts: ExpertWeights, x: torch.Tensor, act: Activation) -> torch.Tensor | None:
    """The shared expert's output [N, H], its sigmoid gate applied (None: the block has none)."""
    if experts.shared_gate_up is None or experts.shared_down is None:
        return None
    shared = _mlp(x, experts.shared_gate_up, experts.shared_down, act)
    if experts.shared_expert_gate is not None:
        shared = torch.sigmoid(F.linear(x, experts.shared_expert_gate)) * shared
    return shared


def _mlp(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Activation
) -> torch.Tensor:
    """down(act(gate·x) ⊙ up·x): x [N, H], gate_up [2F, H], down [H, F] → [N, H]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(act(gate) * up, down)


def _gathered(
    experts: ExpertWeights,
    x: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    act: Activation,
) -> torch.Tensor:
    """Every (token, expert) pair with its expert's matrices gathered: x [S, H] → [S, H]."""
    gate_up = experts.gate_up[chosen]  # [S, k, 2F, H]
    hidden = torch.einsum("sh,skfh->skf", x, gate_up)  # [S, k, 2F]
    gate, up = hidden.chunk(2, dim=-1)
    y = torch.einsum("skf,skhf->skh", act(gate) * up, experts.down[chosen])  # [S, k, H]
    return (y * weights.unsqueeze(-1)).sum(dim=1)


def _per_expert(
    experts: ExpertWeights,
    x: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    act: Activation,
) -> torch.Tensor:
    """Each chosen expert once over the tokens that chose it: x [S, H] → [S, H]."""
    out = torch.zeros_like(x)
    for expert in chosen.unique().tolist():
        token, slot = (chosen == expert).nonzero(as_tuple=True)
        y = _mlp(x[token], experts.gate_up[expert], experts.down[expert], act)  # [n, H]
        out.index_add_(0, token, y * weights[token, slot].unsqueeze(-1))
    return out
