"""`remote-experts`: a mixture-of-experts model's routed experts computed by expert shards over
HTTP (`larql serve --ffn-only --experts A-B`), everything else here.

Per MoE layer the router, the shared expert and any dense MLP run locally; the rows routed to
each expert go to the shard that serves it over the FFN wire (`/v1/experts-ffn`, batch framing:
unit `layer · num_experts + expert`), and the answers are weighted by the routing and summed.
A decode step sends its one row to each shard holding one of its chosen experts, one request per
shard; a prefill sends each chosen expert its own rows. Dense layers run locally. A shard that
does not answer in time or cannot be reached ends the run with `BackendUnavailable` (the remote
client's rules); the shards must cover every expert exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from larql.inference.ffn.backend import DenseFfn, FfnBackend
from larql.inference.ffn.experts import choose_experts, expert_glu, shared_output
from larql.inference.ffn.remote import RemoteWalkFfn
from larql.inference.norm import rms_norm
from larql.models.model import Model


class ExpertShard:
    """The experts [start, stop) one shard serves, and its client."""

    def __init__(self, experts: range, client: RemoteWalkFfn) -> None:
        self.experts = experts
        self.client = client


class RemoteExpertsFfn(FfnBackend):
    """The model's FFN with every routed expert on its shard."""

    graph_safe = False
    kind = "remote experts"

    def __init__(self, model: Model, shards: Sequence[ExpertShard], name: str) -> None:
        routing = model.config.experts
        if routing is None:
            raise ValueError(
                f"remote experts need a mixture-of-experts model; {model.name} is dense"
            )
        covered = sorted(e for shard in shards for e in shard.experts)
        if covered != list(range(routing.num_experts)):
            raise ValueError(
                f"the shards must cover experts 0-{routing.num_experts - 1} of {model.name} "
                f"once each; they cover {_ranges(covered)}"
            )
        self.name = name
        self._model = model
        self._routing = routing
        self._dense = DenseFfn(model)
        self._glu = expert_glu(model.config)
        self._shards = list(shards)
        self._owner = {e: shard for shard in shards for e in shard.experts}

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x: [S, H] pre-FFN-normed → [S, H]."""
        lw = self._model.weights.layers[layer]
        experts = lw.experts
        if experts is None or lw.experts_norm is not None:  # no experts reading x
            return self._dense.forward(layer, x)
        weights, chosen = choose_experts(experts, self._routing, x)  # [S, k] each
        out = self._routed(layer, x, weights, chosen)
        shared = shared_output(experts, x, self._glu)
        if shared is not None:
            out = out + shared
        if lw.w_gate_up is not None:  # a dense MLP beside the experts
            gate, up = F.linear(x, lw.w_gate_up).chunk(2, dim=-1)
            out = out + F.linear(self._glu(gate, up), lw.w_down)
        return out

    def parallel_experts(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """h: [S, H] the residual after attention → the routed experts' output [S, H]."""
        lw = self._model.weights.layers[layer]
        assert lw.experts is not None and lw.experts_norm is not None
        eps = self._model.config.norm_eps
        x = rms_norm(h, lw.experts_norm, eps)  # [S, H] the experts' input
        weights, chosen = choose_experts(lw.experts, self._routing, h, eps)  # [S, k] each
        return self._routed(layer, x, weights, chosen)

    def wire_bytes(self) -> int:
        return sum(shard.client.wire_bytes() for shard in self._shards)

    def close(self) -> None:
        for shard in self._shards:
            shard.client.close()

    def _routed(
        self, layer: int, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
    ) -> torch.Tensor:
        """Σ weight · expert(x) over each row's chosen experts, the experts on their shards."""
        count = self._routing.num_experts
        out = torch.zeros_like(x)
        if x.shape[0] == 1:  # a decode step: one request per shard with its chosen experts
            picks = chosen[0].tolist()
            for shard in self._shards:
                mine = [(slot, e) for slot, e in enumerate(picks) if e in shard.experts]
                if not mine:
                    continue
                answers = shard.client.forward_experts([layer * count + e for _, e in mine], x)
                for slot, e in mine:
                    out += weights[0, slot] * answers[layer * count + e]
            return out
        for expert in chosen.unique().tolist():  # a prefill: each expert its own rows
            token, slot = (chosen == expert).nonzero(as_tuple=True)
            client = self._owner[expert].client
            (y,) = client.forward_experts([layer * count + expert], x[token]).values()
            out.index_add_(0, token, y * weights[token, slot].unsqueeze(-1))
        return out


def _ranges(values: list[int]) -> str:
    return ", ".join(str(v) for v in values) if values else "none"


def parse_moe_shards(text: str) -> list[tuple[range, str]]:
    """`A-B=URL|C-D=URL` (or `,`-separated, as `--moe-shards` takes it) → [(experts, URL)]."""
    shards = []
    for piece in text.replace(",", "|").split("|"):
        experts, eq, url = piece.strip().partition("=")
        first, dash, last = experts.strip().partition("-")
        try:
            start, end = int(first), int(last) if dash else int(first)
        except ValueError:
            raise ValueError(f"{piece.strip()!r} is not A-B=URL") from None
        if not eq or not url.strip() or start < 0 or end < start:
            raise ValueError(f"{piece.strip()!r} is not A-B=URL with 0 ≤ A ≤ B")
        shards.append((range(start, end + 1), url.strip().rstrip("/")))
    return shards
