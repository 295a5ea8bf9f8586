"""Whole decode layers in one compiled call (`larql.kernels.cpu`'s `decode_layers_batch`).

Where float32 rows on the CPU meet plain layers (RMS pre-norms only, no q/k norms, no
post-norms, no soft-cap, the gated SiLU MLP of the model's own weights) whose four matrices are
held in GGUF blocks, and K/V stores that let rows be written in place (`DecodeSlots`), the
layers run as one call: per layer QKV + RoPE, the new K/V rows written into the stores, each
query's attention over its store's live rows (the window's, where one bounds the layer), the
output projection and the MLP with their residuals. It computes what `layer.layer_step`
computes with the same pieces (tested against it); everything else takes `layer_step`'s
operators.

`fused_layers_rows` takes the rows of one session or of several at once (a decode step, a
batched one, a prompt of up to `model_block_rows(model)` rows, or a decode step that carries a new
prompt's chunk): each matrix is read once for all rows, each row writes into and attends over
its own session's store (a prompt's rows causally), and a row's arithmetic is exactly the
one-row call's (a session's tokens do not depend on who shares its step, and a prompt's rows
are the same prefilled alone or beside other sessions' steps). All of a step's layers go in
one call: Python's work per layer (and, in a server, the wait to take the GIL back from the
event loop after each layer) then comes once per step — on SmolLM2 a decode step of one
session went from 6.65 to 5.7 ms, of eight from 11.8 to 10.9.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch

from larql.inference.ffn.backend import FfnBackend
from larql.inference.fused import activation_bits, takes_fused
from larql.inference.layer import effective_window, rope_table
from larql.inference.linear import kernel_rows, model_block_rows
from larql.kernels.cpu import cpu_extension
from larql.kernels.ran import FUSED_LAYERS, ran
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


@dataclass(frozen=True)
class _LayerPlan:
    """One layer's compiled-call arguments that do not change between steps."""

    norms: torch.Tensor  # [attention norm; FFN norm] float32 [2, H]
    matrices: tuple[torch.Tensor, ...]  # W_qkv, W_o, W_gate_up, W_down as the kernels read them
    formats: list[int]  # their format codes (`kernel_rows`)
    qkv_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    bits: int  # the products' `activation_bits`


def _layer_plan(
    model: Model, layer: int, ffn: FfnBackend, kernels: ModuleType
) -> _LayerPlan | None:
    """The layer's plan where the compiled layer applies to it with `ffn`'s MLP, else None;
    kept per model and layer while the same FFN backend asks."""
    key = ("decode_layer_plan", layer)
    cached = model.runtime.get(key)
    if isinstance(cached, tuple) and cached[0]() is ffn:
        return cached[1]
    plan = _new_layer_plan(model, layer, ffn, kernels)
    # (an FFN backend without weak references: worked out at every step)
    with contextlib.suppress(TypeError):
        model.runtime[key] = (weakref.ref(ffn), plan)
    return plan


def _new_layer_plan(
    model: Model, layer: int, ffn: FfnBackend, kernels: ModuleType
) -> _LayerPlan | None:
    lw = model.weights.layers[layer]
    qkv, wo = lw.blocks.get("wqkv"), lw.blocks.get("wo")
    mlp = ffn.silu_blocks(layer)
    if qkv is None or wo is None or mlp is None or not _plain(model, layer):
        return None
    gate_up, down = mlp
    if len({b.activation for b in (qkv, wo, gate_up, down)}) != 1:
        return None
    rows = [kernel_rows(b, kernels) for b in (qkv, wo, gate_up, down)]
    norms = torch.stack((lw.attn_norm, lw.ffn_norm)).contiguous()
    return _LayerPlan(
        norms,
        tuple(data for data, _ in rows),
        [code for _, code in rows],
        lw.bqkv,
        lw.bo,
        activation_bits(qkv),
    )


def _store_rows(
    model: Model,
    layer: int,
    h: torch.Tensor,
    starts: Sequence[int],
    counts: Sequence[int],
    stores: Sequence[object],
    window: int | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], list[int]] | None:
    """For each row of h [R, H] (sequence i's counts[i] rows at positions starts[i]..): its
    session's K and V storage, the first row its query sees and the slot its K/V goes to —
    room reserved in the stores, nothing committed; None where a store is not float32 rows the
    compiled layer may write."""
    slots = [kv.decode_slots(n) for kv, n in zip(stores, counts, strict=True)]  # type: ignore[attr-defined]
    if any(slot is None for slot in slots):  # an empty store: its storage made for these rows
        cfg = model.config
        like = h.new_empty(1, cfg.kv_heads_of(layer), cfg.head_dim_of(layer))
        slots = [
            slot or kv.decode_slots(n, like)  # type: ignore[attr-defined]
            for slot, kv, n in zip(slots, stores, counts, strict=True)
        ]
    if any(slot is None or slot[0].dtype != torch.float32 for slot in slots):
        return None
    w = effective_window(model, layer, window)
    if w is None and all(n == 1 for n in counts):  # a decode step's rows: one per store
        return (
            [slot[0] for slot in slots],  # type: ignore[index]
            [slot[1] for slot in slots],  # type: ignore[index]
            [slot[2] for slot in slots],  # type: ignore[index]
            [slot[3] for slot in slots],  # type: ignore[index]
        )
    k_stores, v_stores, firsts, rows = [], [], [], []
    for (keys, values, first, new), n in zip(slots, counts, strict=True):  # type: ignore[misc]
        for j in range(n):
            k_stores.append(keys)
            v_stores.append(values)
            rows.append(new + j)
            # the query sees its own row and the w − 1 before it
            firsts.append(first if w is None else max(first, new + j + 1 - w))
    return k_stores, v_stores, firsts, rows


# Per layer, each row's (K storages, V storages, first row it sees, slot its K/V goes to).
StoreRows = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[int], Sequence[int]]


def _layer_plans(
    model: Model, layers: Sequence[int], h: torch.Tensor, ffn: FfnBackend
) -> list[_LayerPlan] | None:
    """Every layer's plan where the compiled layer applies to all of them for the rows h (float32
    rows on the CPU, outside autograd and compilers; one activation rounding), else None."""
    kernels = cpu_extension() if takes_fused(h[:1]) else None
    if kernels is None:
        return None
    plans = [_layer_plan(model, layer, ffn, kernels) for layer in layers]
    if any(plan is None for plan in plans) or len({p.bits for p in plans if p}) != 1:
        return None
    return plans  # type: ignore[return-value]


def rows_kv(
    model: Model,
    ffn: FfnBackend,
    layers: Sequence[int],
    rows: torch.Tensor,
    segments: Sequence[tuple[int, int, Sequence[tuple[torch.Tensor, torch.Tensor, int]]]],
) -> bool:
    """The K/V of stored pre-layer residuals by the compiled layer's own projection (`rows_kv`:
    a decode step's arithmetic): rows [N, len(layers), H] float32, each row's rows of every one
    of `layers`, each layer's rows projected for all N at once. The rows come in `segments`,
    one after another: (count, first position, per layer of `layers` (K storage, V storage
    [capacity, Hkv, D], the first row's slot)), its rows at consecutive positions and slots →
    whether it ran (False: the compiled layer does not take these layers; nothing written)."""
    plans = _layer_plans(model, layers, rows[:1, 0], ffn)
    kernels = cpu_extension() if takes_fused(rows[:1, 0]) else None
    if plans is None or kernels is None:
        return False
    positions = [first + i for count, first, _ in segments for i in range(count)]
    ropes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per rope table: [N, rotary] each
    cos_sin = []
    for layer in layers:
        table = rope_table(model, layer)
        if id(table) not in ropes:
            cos, sin = table.rows(positions)
            ropes[id(table)] = cos.contiguous(), sin.contiguous()
        cos_sin.append(ropes[id(table)])
    stores = [store for _, _, per_layer in segments for store in per_layer]
    kernels.rows_kv(
        rows.contiguous(),
        [p.norms[0] for p in plans],
        model.config.norm_eps,
        [p.matrices[0] for p in plans],
        [p.formats[0] for p in plans],
        [p.qkv_bias for p in plans],
        [cos for cos, _ in cos_sin],
        [sin for _, sin in cos_sin],
        [count for count, _, _ in segments],
        [k for k, _, _ in stores],
        [v for _, v, _ in stores],
        [slot for _, _, slot in stores],
        model.config.num_heads,
        plans[0].bits,
    )
    return True


def layers_compile(model: Model, layers: Sequence[int], h: torch.Tensor, ffn: FfnBackend) -> bool:
    """Whether `fused_layers_rows` takes these layers for the rows h (before any store is
    touched: a caller reserving rows itself asks first)."""
    return model.shard is None and _layer_plans(model, layers, h, ffn) is not None


def layer_arguments(
    model: Model, layers: Sequence[int], h: torch.Tensor, ffn: FfnBackend, positions: list[int]
) -> tuple[list[object], int] | None:
    """The compiled layer calls' arguments that come before each row's store (h, the norms,
    eps, the four matrices, their formats, the biases, each layer's cos / sin at the rows'
    `positions`) and the products' `activation_bits`, where the compiled layer applies to all
    of `layers` for the rows h; else None (a tensor-parallel rank's layers, which sum their
    partial outputs with the other ranks' between the calls' pieces)."""
    if model.shard is not None:
        return None
    plans = _layer_plans(model, layers, h, ffn)
    if plans is None:
        return None
    ropes = [rope_table(model, layer).rows(positions) for layer in layers]  # [R, rotary] each
    arguments = [
        h.contiguous(),
        [p.norms for p in plans],
        model.config.norm_eps,
        *([p.matrices[i] for p in plans] for i in range(4)),
        [p.formats for p in plans],
        [p.qkv_bias for p in plans],
        [p.o_bias for p in plans],
        [cos.contiguous() for cos, _ in ropes],
        [sin.contiguous() for _, sin in ropes],
    ]
    return arguments, plans[0].bits


def fused_layers_rows(
    model: Model,
    layers: Sequence[int],
    h: torch.Tensor,
    starts: Sequence[int],
    counts: Sequence[int],
    stores: Sequence[Sequence[object]],
    ffn: FfnBackend,
    window: int | None,
    reserved: Sequence[StoreRows] | None = None,
    layer_inputs: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """h: [R, H], the rows of several sessions one after another: session i's counts[i] rows
    at positions starts[i].. (one for a decode step, more for a prompt or a chunk of one) →
    the residuals after `layers` [R, H], in one compiled call; stores[k][i]: session i's store
    of layers[k]. Each row's K/V is written into its session's store, and each row attends
    over that store up to itself (causal within a prompt's rows). `reserved`: the rows' places
    in the stores, per layer, already reserved by the caller, who then counts them (`stores`
    are not touched). `layer_inputs` (float32 [len(layers), R, H], or None) gets each layer's
    input rows. None where the compiled layer does not apply to every layer and row (nothing
    is changed)."""
    positions = [start + j for start, n in zip(starts, counts, strict=True) for j in range(n)]
    arguments = layer_arguments(model, layers, h, ffn, positions)
    if arguments is None:
        return None
    kernels = cpu_extension()
    assert kernels is not None  # `layer_arguments` checked `takes_fused`
    if reserved is not None:
        if any(keys[0].dtype != torch.float32 for keys, _, _, _ in reserved):
            return None
        per_layer = list(reserved)
    else:
        # (hasattr, not isinstance: a runtime Protocol check costs ~10 µs, per layer and session)
        if not all(hasattr(kv, "decode_slots") for layer_stores in stores for kv in layer_stores):
            return None
        per_layer = []
        for layer, layer_stores in zip(layers, stores, strict=True):
            rows = _store_rows(model, layer, h, starts, counts, layer_stores, window)
            if rows is None:
                return None
            per_layer.append(rows)
    leading, bits = arguments
    ran(FUSED_LAYERS)
    out = kernels.decode_layers_batch(
        *leading,
        *([rows[i] for rows in per_layer] for i in range(4)),
        model.config.num_heads,
        model.config.attn_scale,
        bits,
        layer_inputs,
    )
    if reserved is None:
        for layer_stores in stores:
            for kv, n in zip(layer_stores, counts, strict=True):
                kv.commit_rows(n)  # type: ignore[attr-defined]
    return out


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
    """`fused_layers_rows` for one layer."""
    return fused_layers_rows(model, [layer], h, starts, counts, [stores], ffn, window)


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
    than `model_block_rows(model)` (a longer prompt's products are faster on the float matrices)."""
    if h.shape[0] > model_block_rows(model):
        return None
    return fused_layer_rows(model, layer, h, [start], [h.shape[0]], [kv], ffn, window)
