"""A mixture-of-experts block: the router picks each token's top-k experts and the block returns
their gated MLP outputs weighed by the routing, plus the shared expert where there is one.

Two ways to run the same arithmetic: with few (token, expert) pairs — a decode step — or while a
CUDA graph is being captured (a batched decode step), every pair gathers its expert's matrices
(static shapes, no host sync, and it reads only the chosen experts); with many — a prefill —
each expert that was chosen runs once over all the tokens that chose it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from larql.inference.ffn.activation import gated_product
from larql.models.config import ExpertRouting, ModelConfig
from larql.models.weights import ExpertWeights

# (gate, up) pre-activations → the expert's hidden activations
Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def expert_glu(config: ModelConfig) -> Glu:
    """How the model's experts (and shared expert) combine gate and up."""
    routing = config.experts
    if routing is not None and routing.clamped_swiglu is not None:
        alpha, limit = routing.clamped_swiglu
        return partial(_clamped_swiglu, alpha=alpha, limit=limit)
    return partial(gated_product, activation=config.arch.activation)


def _clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float
) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)


def route(logits: torch.Tensor, routing: ExpertRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [S, E] → (weights [S, k], float32 or wider; expert indices [S, k]): softmax
    over every expert, the top k, renormalised to sum to 1 where the architecture does (which
    is a softmax over the top k logits)."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays float64
    probs = torch.softmax(wide, dim=-1)
    weights, chosen = probs.topk(routing.top_k, dim=-1)
    if routing.normalize_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def router_logits(experts: ExpertWeights, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x: [S, H] → [S, E]. A router with a `router_scale` (Gemma 4) reads x through a
    weightless RMS norm (`eps`) × that scale × 1/√H."""
    if experts.router_scale is not None:
        x = F.rms_norm(x, (x.shape[-1],), None, eps) * experts.router_scale * x.shape[-1] ** -0.5
    return F.linear(x, experts.router, experts.router_bias)


def choose_experts(
    experts: ExpertWeights, routing: ExpertRouting, router_input: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's pick for rows [S, H] → (weights [S, k] in the rows' dtype, experts [S, k]),
    × each chosen expert's own scale where the block has one."""
    weights, chosen = route(router_logits(experts, router_input, eps), routing)  # [S, k] each
    if experts.per_expert_scale is not None:
        weights = weights * experts.per_expert_scale[chosen]
    return weights.to(router_input.dtype), chosen


def experts_forward(
    experts: ExpertWeights,
    routing: ExpertRouting,
    x: torch.Tensor,
    glu: Glu,
    router_input: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """x: [S, H] the experts' input → the block's output [S, H]. The router reads
    `router_input` where the block routes on something else (Gemma 4: the raw residual)."""
    routed_on = x if router_input is None else router_input
    weights, chosen = choose_experts(experts, routing, routed_on, eps)  # [S, k] each
    out = routed_sum(experts, x, weights, chosen, glu)
    shared = shared_output(experts, x, glu)  # [S, H] or None
    return out if shared is None else out + shared


def routed_sum(
    experts: ExpertWeights, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, glu: Glu
) -> torch.Tensor:
    """Σ weight · expert(x) over each row's chosen experts: x [S, H], weights / chosen [S, k]
    → [S, H]."""
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()  # no host syncs then
    # (nor on the meta device, a model's structure: no values to pick experts by)
    if chosen.numel() <= experts.router.shape[0] or capturing or x.is_meta:
        return _gathered(experts, x, weights, chosen, glu)
    return _per_expert(experts, x, weights, chosen, glu)


def expert_output(experts: ExpertWeights, expert: int, x: torch.Tensor, glu: Glu) -> torch.Tensor:
    """One expert's MLP of rows x [N, H], not weighted by the routing → [N, H] (what a remote
    expert shard computes)."""
    gate_up_bias = experts.gate_up_bias[expert] if experts.gate_up_bias is not None else None
    down_bias = experts.down_bias[expert] if experts.down_bias is not None else None
    return _mlp(x, experts.gate_up[expert], experts.down[expert], glu, gate_up_bias, down_bias)


def shared_output(experts: ExpertWeights, x: torch.Tensor, glu: Glu) -> torch.Tensor | None:
    """The shared expert's output [N, H], its sigmoid gate applied (None: the block has none)."""
    if experts.shared_gate_up is None or experts.shared_down is None:
        return None
    shared = _mlp(x, experts.shared_gate_up, experts.shared_down, glu)
    if experts.shared_expert_gate is not None:
        shared = torch.sigmoid(F.linear(x, experts.shared_expert_gate)) * shared
    return shared


def _mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    glu: Glu,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """down(glu(gate·x, up·x)): x [N, H], gate_up [2F, H], down [H, F] → [N, H]."""
    gate, up = F.linear(x, gate_up, gate_up_bias).chunk(2, dim=-1)
    return F.linear(glu(gate, up), down, down_bias)


def _gathered(
    experts: ExpertWeights,
    x: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    glu: Glu,
) -> torch.Tensor:
    """Every (token, expert) pair with its expert's matrices gathered: x [S, H] → [S, H]."""
    hidden = torch.einsum("sh,skfh->skf", x, experts.gate_up[chosen])  # [S, k, 2F]
    if experts.gate_up_bias is not None:
        hidden = hidden + experts.gate_up_bias[chosen]
    gate, up = hidden.chunk(2, dim=-1)
    y = torch.einsum("skf,skhf->skh", glu(gate, up), experts.down[chosen])  # [S, k, H]
    if experts.down_bias is not None:
        y = y + experts.down_bias[chosen]
    return (y * weights.unsqueeze(-1)).sum(dim=1)


def _per_expert(
    experts: ExpertWeights,
    x: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    glu: Glu,
) -> torch.Tensor:
    """Each chosen expert once over the tokens that chose it: x [S, H] → [S, H]."""
    out = torch.zeros_like(x)
    for expert in chosen.unique().tolist():
        token, slot = (chosen == expert).nonzero(as_tuple=True)
        y = expert_output(experts, expert, x[token], glu)  # [n, H]
        out.index_add_(0, token, y * weights[token, slot].unsqueeze(-1))
    return out
