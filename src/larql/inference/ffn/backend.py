"""The FFN side of a layer, behind one interface so engines never care how it is computed.

An `FfnBackend` takes the *pre-FFN-normed* residual of one layer and returns the raw FFN output;
the caller applies the post-FFN norm (if any) and the residual add (`layer.ffn_block`). The
backends a policy can name: `DenseFfn` and `NullFfn` here, `WalkFfn` (`walk`), `RemoteWalkFfn`
(`remote`); `policy` binds them to layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from larql.inference.errors import BackendUnavailable
from larql.inference.ffn.activation import gated_product
from larql.inference.ffn.experts import expert_glu, experts_forward
from larql.inference.fused import activation_bits, takes_fused
from larql.inference.linear import kernel_rows, linear
from larql.inference.norm import rms_norm
from larql.inference.row_products import gated_residual_linear, normed_linear
from larql.kernels import gemv_kernels
from larql.kernels.cpu import cpu_extension
from larql.kernels.ran import FUSED_PIECES, ran
from larql.models.blocks import BlockRows
from larql.models.model import Model


class FfnBackend(ABC):
    """`graph_safe`: the forward launches only device work of static shapes, so a decode step
    calling it can be captured in a CUDA graph. `close()` frees what the backend holds open
    (a remote one's connections)."""

    name: str = ""
    graph_safe: bool = False
    # what kind of backend it is, in words an engine's refusal names (`Engine.refused_ffn`)
    kind: str = "dense"

    @abstractmethod
    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x: [S, H] pre-FFN-normed → FFN output [S, H]."""

    def fused_block(
        self, layer: int, h: torch.Tensor, norm: torch.Tensor, eps: float
    ) -> torch.Tensor | None:
        """h + FFN(rms_norm(h)) [S, H] where this backend has a fused form for h — one call
        of the CPU extension, or two launches for a decode row on CUDA — else None (the
        caller then norms, calls `forward` and adds)."""
        return None

    def parallel_experts(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """On a layer whose experts sit beside its dense MLP and norm their own input (Gemma 4,
        `LayerWeights.experts_norm`): the routed experts' output [S, H] for the residual after
        attention h [S, H]; `forward` is then the dense MLP alone."""
        raise BackendUnavailable(
            f"the {self.name} FFN backend cannot run experts that sit beside a dense MLP "
            f"(layer {layer}); use dense, walk or remote-experts"
        )

    def silu_blocks(self, layer: int) -> tuple[BlockRows, BlockRows] | None:
        """(W_gate_up, W_down) in GGUF blocks where this backend is the model's own gated SiLU
        MLP over them — what a compiled whole-layer decode step may run in its place."""
        return None

    def wire_bytes(self) -> int:
        """Bytes this backend has sent and received over a network so far (0: it is local)."""
        return 0

    def kinds(self) -> frozenset[str]:
        """The kinds of backend it runs (a per-layer policy: every one of its backends')."""
        return frozenset({self.kind})

    def close(self) -> None:
        return None


class DenseFfn(FfnBackend):
    """The model's own FFN: its gated MLP down(act(gate·x) ⊙ up·x), gate and up in one matmul;
    on a mixture-of-experts layer its routed experts (`experts.experts_forward`), added to the
    dense MLP where the layer has both and they read the same input (`parallel_experts` where
    the experts norm their own)."""

    name = "dense"
    graph_safe = True

    def __init__(self, model: Model) -> None:
        self._layers = model.weights.layers
        self._activation = model.config.arch.activation
        self._routing = model.config.experts
        self._glu = expert_glu(model.config)
        self._eps = model.config.norm_eps

    def silu_blocks(self, layer: int) -> tuple[BlockRows, BlockRows] | None:
        lw = self._layers[layer]
        if lw.experts is not None:
            return None
        gate_up, down = lw.blocks.get("w_gate_up"), lw.blocks.get("w_down")
        if gate_up is None or down is None or self._activation != "silu":
            return None
        return gate_up, down

    def fused_block(
        self, layer: int, h: torch.Tensor, norm: torch.Tensor, eps: float
    ) -> torch.Tensor | None:
        blocks = self.silu_blocks(layer)
        kernels = cpu_extension() if blocks is not None and takes_fused(h, blocks[0]) else None
        if blocks is None or kernels is None:
            return self._row_products(layer, h, norm, eps)
        gate_up, down = blocks
        ran(FUSED_PIECES)
        return kernels.residual_ffn(
            h.contiguous(),
            norm,
            eps,
            *kernel_rows(gate_up, kernels),
            *kernel_rows(down, kernels),
            activation_bits(gate_up),
        )  # [1, H]

    def _row_products(
        self, layer: int, h: torch.Tensor, norm: torch.Tensor, eps: float
    ) -> torch.Tensor | None:
        """`fused_block` as two launches for a decode row on CUDA (`larql.kernels.gemv`): the
        norm folded into the gate/up product, SiLU · up and the residual add into the down
        product. None where those kernels do not run, or the MLP is not a gated SiLU one."""
        lw = self._layers[layer]
        if lw.experts is not None or self._activation != "silu" or lw.w_gate_up is None:
            return None
        if lw.w_down is None or gemv_kernels(h, lw.w_gate_up) is None:
            return None
        gate_up = normed_linear(h, norm, eps, lw.w_gate_up)  # [1, 2F]
        return gated_residual_linear(h, gate_up, lw.w_down)  # [1, H]

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        lw = self._layers[layer]
        out = None
        if lw.w_gate_up is not None and lw.w_down is not None:
            gate, up = linear(x, lw.w_gate_up, blocks=lw.blocks.get("w_gate_up")).chunk(2, dim=-1)
            out = linear(
                gated_product(gate, up, self._activation), lw.w_down, blocks=lw.blocks.get("w_down")
            )  # [S, H]
        if lw.experts is not None and lw.experts_norm is None and self._routing is not None:
            routed = experts_forward(lw.experts, self._routing, x, self._glu)  # [S, H]
            out = routed if out is None else out + routed
        assert out is not None, "every layer has an MLP or experts (checked at load)"
        return out

    def parallel_experts(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        lw = self._layers[layer]
        assert lw.experts is not None and lw.experts_norm is not None and self._routing
        x = rms_norm(h, lw.experts_norm, self._eps)  # [S, H] the experts' input
        return experts_forward(lw.experts, self._routing, x, self._glu, h, self._eps)


class NullFfn(FfnBackend):
    """The FFN ablated: it contributes nothing, so the layer is attention only (zeros, not the
    identity: an ablation study removes the FFN's write, and a post-FFN norm of zeros is still
    zero)."""

    name = "null"
    kind = "null"
    graph_safe = True

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)  # [S, H]

    def parallel_experts(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(h)  # [S, H]
