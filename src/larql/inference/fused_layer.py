"""A whole decode layer in one compiled call (`larql.kernels.cpu`'s `decode_layer`).

Where one float32 row on the CPU meets a plain layer (RMS pre-norms only, no q/k norms, no
post-norms, no soft-cap, the gated SiLU MLP of the model's own weights) whose four matrices are
held in GGUF blocks, and a K/V store that lets a row be written in place (`DecodeSlots`), the
layer runs as one call: QKV + RoPE, the new K/V row written into the store, one query's
attention over the live rows (the window's, where one bounds the layer), the output projection
and the MLP with their residuals. It computes what `layer.layer_step` computes with the same
pieces (tested against it); everything else takes `layer_step`'s operators.

`fused_layer_batch` is the same layer for B rows of B sessions (a batched decode step): each
matrix is read once for all rows, each row writes and attends over its own session's store, and
a row's arithmetic is exactly the one-row call's (a session's tokens do not depend on who shares
its step).
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch

from larql.inference.ffn.backend import FfnBackend
from larql.inference.fused import activation_bits, fused_kernels
from larql.inference.layer import effective_window, rope_table
from larql.inference.linear import kernel_rows
from larql.models.blocks import BlockRows
from larql.models.model import Model


class DecodeSlots(Protocol):
    """A K/V store a compiled decode layer writes its new row into."""

    def decode_slot(self) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
        """→ (K storage, V storage [capacity, Hkv, D], first live row, the new row's index)."""
        ...

    def commit_decode_row(self) -> None: ...


def _plain(model: Model, layer: int) -> bool:
    lw = model.weights.layers[layer]
    arch = model.config.arch
    return (
        lw.q_norm is None
        and lw.k_norm is None
        and lw.post_attn_norm is None
        and lw.post_ffn_norm is None
        and arch.attn_softcap is None
        and lw.attn_sinks is None
        and lw.layer_scalar is None
        and lw.per_layer_gate is None
        and not model.config.shares_kv  # its attention is inside the kernel: nothing to share
        and lw.experts_norm is None
        and not arch.v_norm
    )


def _norms(model: Model, layer: int) -> torch.Tensor:
    """The layer's [attention norm; FFN norm] weights, float32 [2, H] (kept per model)."""
    key = ("decode_layer_norms", layer)
    norms = model.runtime.get(key)
    if norms is None:
        lw = model.weights.layers[layer]
        norms = model.runtime[key] = torch.stack((lw.attn_norm, lw.ffn_norm)).contiguous()
    return norms


def _matrices(kernels: ModuleType, *blocks: BlockRows) -> tuple:
    """The compiled layer's four matrix arguments and their format codes (`kernel_rows`)."""
    rows = [kernel_rows(b, kernels) for b in blocks]
    return (*(data for data, _ in rows), [code for _, code in rows])


def _compiled_pieces(model: Model, layer: int, h: torch.Tensor, ffn: FfnBackend) -> tuple | None:
    """(kernels, W_qkv, W_o, W_gate_up, W_down) in blocks of one activation kind, where the
    compiled layer applies to the rows h, else None."""
    kernels = fused_kernels(h[:1])  # float32 rows on the CPU, outside autograd and compilers
    lw = model.weights.layers[layer]
    qkv, wo = lw.blocks.get("wqkv"), lw.blocks.get("wo")
    mlp = ffn.silu_blocks(layer)
    if kernels is None or qkv is None or wo is None or mlp is None or not _plain(model, layer):
        return None
    gate_up, down = mlp
    if len({b.activation for b in (qkv, wo, gate_up, down)}) != 1:
        return None
    return kernels, qkv, wo, gate_up, down


def fused_layer_batch(
    model: Model,
    layer: int,
    h: torch.Tensor,
    positions: list[int],
    stores: list[object],
    ffn: FfnBackend,
    window: int | None,
) -> torch.Tensor | None:
    """h: [B, H], row i session i's token at positions[i] → the residuals after the whole layer
    [B, H], each row's K/V committed to stores[i]; None where the compiled layer does not apply
    to every row (nothing is changed)."""
    pieces = _compiled_pieces(model, layer, h, ffn)
    # (hasattr, not isinstance: a runtime Protocol check costs ~10 µs, per layer and session)
    if pieces is None or not all(hasattr(kv, "decode_slot") for kv in stores):
        return None
    kernels, qkv, wo, gate_up, down = pieces
    matrices = _matrices(kernels, qkv, wo, gate_up, down)
    slots = [kv.decode_slot() for kv in stores]  # type: ignore[attr-defined]
    if any(slot is None or slot[0].dtype != torch.float32 for slot in slots):
        return None
    w = effective_window(model, layer, window)
    firsts = [
        first if w is None else max(first, row + 1 - w) for _, _, first, row in slots
    ]  # fmt: skip
    cfg, lw = model.config, model.weights.layers[layer]
    cos, sin = rope_table(model, layer).rows(positions)  # [B, rotary] each
    out = kernels.decode_layer_batch(
        h.contiguous(), _norms(model, layer), cfg.norm_eps, *matrices, lw.bqkv, lw.bo,
        cos.contiguous(), sin.contiguous(),
        [slot[0] for slot in slots], [slot[1] for slot in slots], firsts,
        [slot[3] for slot in slots], cfg.num_heads, cfg.attn_scale, activation_bits(qkv),
    )  # fmt: skip
    for kv in stores:
        kv.commit_decode_row()  # type: ignore[attr-defined]
    return out


def fused_layer_step(
    model: Model,
    layer: int,
    h: torch.Tensor,
    start: int,
    kv: object,
    ffn: FfnBackend,
    window: int | None,
) -> torch.Tensor | None:
    """h: [1, H] at position `start` → the residual after the whole layer [1, H], its K/V row
    committed to `kv`; None where the compiled layer does not apply (nothing is changed)."""
    if h.shape[0] != 1 or not hasattr(kv, "decode_slot"):
        return None
    pieces = _compiled_pieces(model, layer, h, ffn)
    if pieces is None:
        return None
    kernels, qkv, wo, gate_up, down = pieces
    matrices = _matrices(kernels, qkv, wo, gate_up, down)
    lw = model.weights.layers[layer]
    slot = kv.decode_slot()  # type: ignore[attr-defined]
    if slot is None:
        return None
    keys, values, first, row = slot
    if keys.dtype != torch.float32:
        return None
    w = effective_window(model, layer, window)
    if w is not None:
        first = max(first, row + 1 - w)  # the query sees its own row and the w − 1 before it
    cfg = model.config
    cos, sin = rope_table(model, layer).slice(start, 1)  # [1, rotary] each
    out = kernels.decode_layer(
        h.contiguous(), _norms(model, layer), cfg.norm_eps, *matrices, lw.bqkv, lw.bo,
        cos.reshape(-1), sin.reshape(-1), keys, values, first, row, cfg.num_heads,
        cfg.attn_scale, activation_bits(qkv),
    )  # fmt: skip
    kv.commit_decode_row()  # type: ignore[attr-defined]
    return out
