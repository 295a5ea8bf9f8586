"""A whole decode layer in one compiled call (`larql.kernels.cpu`'s `decode_layer`).

Where one float32 row on the CPU meets a plain layer (RMS pre-norms only, no q/k norms, no
post-norms, no soft-cap, the gated SiLU MLP of the model's own weights) whose four matrices are
held in GGUF blocks, and a K/V store that lets a row be written in place (`DecodeSlots`), the
layer runs as one call: QKV + RoPE, the new K/V row written into the store, one query's
attention over the live rows (the window's, where one bounds the layer), the output projection
and the MLP with their residuals. It computes what `layer.layer_step` computes with the same
pieces (tested against it); everything else takes `layer_step`'s operators.

`fused_layer_rows` is the same layer for the rows of several sessions at once (a batched
decode step, a prompt of up to `block_rows()` rows, or both: a decode step that carries a new
prompt's chunk): each
matrix is read once for all rows, each row writes into and attends over its own session's store
(a prompt's rows causally), and a row's arithmetic is exactly the one-row call's (a session's
tokens do not depend on who shares its step, and a prompt's rows are the same prefilled alone
or beside other sessions' steps).
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch

from larql.inference.ffn.backend import FfnBackend
from larql.inference.fused import activation_bits, fused_kernels
from larql.inference.layer import effective_window, rope_table
from larql.inference.linear import block_rows, kernel_rows
from larql.models.blocks import BlockRows
from larql.models.model import Model


class DecodeSlots(Protocol):
    """A K/V store a compiled decode layer writes its new rows into."""

    def decode_slots(
        self, rows: int = 1, like: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
        """→ (K storage, V storage [capacity, Hkv, D], first live row, the first new row's
        index); an empty store's storage made like `like` [1, Hkv, D]."""
        ...

    def commit_rows(self, rows: int = 1) -> None: ...


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


def fused_layer_rows(
    model: Model,
    layer: int,
    h: torch.Tensor,
    starts: list[int],
    counts: list[int],
    stores: list[object],
    ffn: FfnBackend,
    window: int | None,
) -> torch.Tensor | None:
    """h: [R, H], the rows of several sessions one after another: session i's counts[i] rows
    at positions starts[i].. (one for a decode step, more for a prompt or a chunk of one) →
    the residuals after the whole layer [R, H]. Each row's K/V is written into its session's
    store, and each row attends over that store up to itself (causal within a prompt's rows).
    None where the compiled layer does not apply to every row (nothing is changed)."""
    pieces = _compiled_pieces(model, layer, h, ffn)
    # (hasattr, not isinstance: a runtime Protocol check costs ~10 µs, per layer and session)
    if pieces is None or not all(hasattr(kv, "decode_slots") for kv in stores):
        return None
    kernels, qkv, wo, gate_up, down = pieces
    matrices = _matrices(kernels, qkv, wo, gate_up, down)
    cfg, lw = model.config, model.weights.layers[layer]
    slots = [kv.decode_slots(n) for kv, n in zip(stores, counts, strict=True)]  # type: ignore[attr-defined]
    if any(slot is None for slot in slots):  # an empty store: its storage made for these rows
        like = h.new_empty(1, cfg.kv_heads_of(layer), cfg.head_dim_of(layer))
        slots = [
            slot or kv.decode_slots(n, like)  # type: ignore[attr-defined]
            for slot, kv, n in zip(slots, stores, counts, strict=True)
        ]
    if any(slot is None or slot[0].dtype != torch.float32 for slot in slots):
        return None
    w = effective_window(model, layer, window)
    k_stores, v_stores, firsts, rows, positions = [], [], [], [], []
    for (keys, values, first, new), n, start in zip(slots, counts, starts, strict=True):  # type: ignore[misc]
        for j in range(n):
            k_stores.append(keys)
            v_stores.append(values)
            rows.append(new + j)
            # the query sees its own row and the w − 1 before it
            firsts.append(first if w is None else max(first, new + j + 1 - w))
            positions.append(start + j)
    cos, sin = rope_table(model, layer).rows(positions)  # [R, rotary] each
    out = kernels.decode_layer_batch(
        h.contiguous(), _norms(model, layer), cfg.norm_eps, *matrices, lw.bqkv, lw.bo,
        cos.contiguous(), sin.contiguous(), k_stores, v_stores, firsts, rows, cfg.num_heads,
        cfg.attn_scale, activation_bits(qkv),
    )  # fmt: skip
    for kv, n in zip(stores, counts, strict=True):
        kv.commit_rows(n)  # type: ignore[attr-defined]
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
    """h: [S, H] of one session at positions `start`.. (a decode step, a short prompt or a
    chunk of one) → the residuals after the whole layer [S, H], its K/V rows committed to
    `kv`; None where the compiled layer does not apply (nothing is changed), or for more rows
    than `block_rows()` (a longer prompt's products are faster on the float matrices)."""
    if h.shape[0] > block_rows():
        return None
    return fused_layer_rows(model, layer, h, [start], [h.shape[0]], [kv], ffn, window)
