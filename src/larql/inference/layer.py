"""The shared per-layer math. Every engine composes these functions and nothing else:

    embed → for each layer: attention_block (K/V handed to the engine's `KvSink`) → ffn_block
          → final_logits

`recompute_kv` rebuilds a layer's K/V from stored pre-layer residuals through the very same
norm / projection / k-norm / RoPE code as `attention_block`.

Shapes: S query rows, T key rows, H hidden, D head_dim, Hq/Hkv query/kv heads.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from larql.inference.errors import InvariantViolation
from larql.inference.ffn import FfnBackend
from larql.inference.ffn.activation import gated_activation
from larql.inference.fused import activation_bits, takes_fused, takes_fused_attention
from larql.inference.linear import kernel_rows, linear
from larql.inference.norm import LOW_PRECISION, rms_norm
from larql.inference.rope import RopeTable, apply_rope
from larql.inference.row_products import normed_linear, normed_linear_rope, residual_linear
from larql.inference.shared_kv import SharedKv, shares
from larql.kernels import DecodeAttention, elementwise_kernels
from larql.kernels.cpu import cpu_extension
from larql.kernels.ran import FUSED_PIECES, ran
from larql.models.model import Model

# fused attention on CUDA where shapes vary per call: every backend but cuDNN (see `attend`)
# A masked prompt (a window, an engine's `allowed`) whose scores would pass this many elements
# (Hq · S · T: 1 GiB in float32) attends in blocks of queries, each over the keys it can reach:
# where no fused kernel takes the mask (grouped heads on CUDA, soft-caps, sinks) the scores are
# materialised, and a 32,000-token windowed prompt asked for 122 GiB at once.
MASKED_SCORES_LIMIT = 1 << 28

_VARYING_SHAPE_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


class KvSink(Protocol):
    """Where an engine keeps a layer's K/V. `append` takes the new rows and returns every key
    and value the new queries may attend to, oldest first, ending with the new rows (keys are
    contiguous absolute positions ending at the last query's)."""

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [Hkv, S, D] → keys, values: [Hkv, T, D] with T ≥ S."""
        ...


class FreshKv:
    """A K/V sink with no history: the keys are exactly the new rows (prefill, recompute)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k, self.v = k, v
        return k, v


def rope_table(model: Model, layer: int) -> RopeTable:
    spec = model.config.layers[layer].rope
    key = ("rope", spec, model.dtype, model.device)
    table = model.runtime.get(key)
    if table is None:
        table = model.runtime[key] = RopeTable(spec, model.dtype, model.device)
    return table


def embed(model: Model, token_ids: torch.Tensor) -> torch.Tensor:
    """token_ids: [S] → [S, H]."""
    h = F.embedding(token_ids.to(model.device), model.weights.embed)
    scale = model.config.embed_scale
    return h * scale if scale != 1.0 else h


def per_layer_inputs(
    model: Model, h: torch.Tensor, token_ids: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Each row's input to every layer, for a model with per-layer inputs (Gemma 4's PLE; None
    for every other model): embedded rows h [S, H] → [S, L, P]. The embedding projected
    (× 1/√H) and RMS-normed per layer; for token rows, plus the token's own row of the
    per-layer table (× √P), the sum × 1/√2. Rows given as hidden states (no token ids) take
    the projection alone."""
    table = model.weights.per_layer
    if table is None:
        return None
    s, layers, width = h.shape[0], model.config.num_layers, table.norm.shape[0]
    projected = linear(h, table.projection) * model.config.hidden_size**-0.5  # [S, L·P]
    projected = rms_norm(projected.view(s, layers, width), table.norm, model.config.norm_eps)
    if token_ids is None:
        return projected  # [S, L, P]
    own = F.embedding(token_ids.to(h.device), table.table).view(s, layers, width)
    return (projected + own * width**0.5) * 2**-0.5  # [S, L, P]


def embed_rows(model: Model, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_ids: [S] → their embedded rows [S, H] and per-layer inputs [S, L, P] (or None)."""
    h = embed(model, token_ids)
    return h, per_layer_inputs(model, h, token_ids)


def kept_rows(window: int | None) -> int | None:
    """K/V rows a layer must keep for later queries when each query sees `window` keys,
    itself included: window − 1 (None: every row)."""
    return None if window is None else window - 1


def token_tensor(model: Model, token_ids: list[int] | tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(token_ids, dtype=torch.long, device=model.device)


def effective_window(model: Model, layer: int, engine_window: int | None) -> int | None:
    """Keys a query may see on this layer, itself included: the smaller of the architecture's
    sliding window and the engine's (None = unbounded)."""
    arch_window = model.config.layers[layer].sliding_window
    if arch_window is None:
        return engine_window
    if engine_window is None:
        return arch_window
    return min(arch_window, engine_window)


def _heads_k_v(
    model: Model,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v: [S, kv_dim] projections → k (k-normed, rotated), v: [Hkv, S, D]."""
    cfg = model.config
    lw = model.weights.layers[layer]
    s = k.shape[0]
    kv_heads, dim = cfg.kv_heads_of(layer), cfg.head_dim_of(layer)
    k = k.view(s, kv_heads, dim)
    if lw.k_norm is not None:
        k = rms_norm(k, lw.k_norm, cfg.norm_eps)
    k = apply_rope(k.transpose(0, 1), cos, sin)
    v = v.view(s, kv_heads, dim)
    if cfg.arch.v_norm:
        v = F.rms_norm(v, (dim,), None, cfg.norm_eps)
    return k, v.transpose(0, 1)


def project_qkv(
    model: Model, layer: int, h: torch.Tensor, start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pre-layer residual h: [S, H] at positions start.. → q [Hq,S,D], k [Hkv,S,D], v [Hkv,S,D]."""
    cos, sin = rope_table(model, layer).slice(start, h.shape[0])
    return project_qkv_with_rope(model, layer, h, cos, sin)


def project_qkv_with_rope(
    model: Model, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`project_qkv` with the rows' RoPE cos/sin [S, rotary_dim] given (they may be gathered
    by a position tensor on the device, for a captured CUDA graph)."""
    cfg = model.config
    lw = model.weights.layers[layer]
    s = h.shape[0]
    blocks = lw.blocks.get("wqkv")
    plain = lw.q_norm is None and lw.k_norm is None
    heads, kv_heads, dim = cfg.num_heads, cfg.kv_heads_of(layer), cfg.head_dim_of(layer)
    q_dim, kv_dim = cfg.q_dim_of(layer), cfg.kv_dim_of(layer)
    fused = plain and blocks is not None and takes_fused(h, blocks)
    if fused and (kernels := cpu_extension()) is not None:
        # a few rows: norm, product and RoPE of q and k in one compiled call
        ran(FUSED_PIECES)
        qkv = kernels.decode_qkv(
            h.contiguous(),
            lw.attn_norm,
            cfg.norm_eps,
            *kernel_rows(blocks, kernels),
            lw.bqkv,
            cos.contiguous(),
            sin.contiguous(),
            heads + kv_heads,
            dim,
            activation_bits(blocks),
        )  # [S, q_dim + 2·kv_dim]
        q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
        return (
            q.view(s, heads, dim).transpose(0, 1),
            k.view(s, kv_heads, dim).transpose(0, 1),
            v.view(s, kv_heads, dim).transpose(0, 1),
        )
    if (
        plain
        and (
            rotated := normed_linear_rope(
                h, lw.attn_norm, cfg.norm_eps, lw.wqkv, lw.bqkv, cos, sin, heads + kv_heads, dim
            )
        )
        is not None
    ):
        # a decode row on CUDA: norm, product and q and k's RoPE in one launch
        q, k, v = rotated.split([q_dim, kv_dim, kv_dim], dim=-1)  # [1, ·] each
        return (
            q.view(s, heads, dim).transpose(0, 1),
            k.view(s, kv_heads, dim).transpose(0, 1),
            v.view(s, kv_heads, dim).transpose(0, 1),
        )
    qkv = normed_linear(h, lw.attn_norm, cfg.norm_eps, lw.wqkv, lw.bqkv, blocks)  # [S, q+2·kv]
    if plain:
        # q and k rotate together: one set of RoPE kernels for both
        qk = qkv[:, : q_dim + kv_dim].view(s, heads + kv_heads, -1)
        qk = apply_rope(qk.transpose(0, 1), cos, sin)  # [Hq + Hkv, S, D]
        q, k = qk.split([heads, kv_heads])
        v = qkv[:, q_dim + kv_dim :].view(s, kv_heads, dim)
        return q, k, v.transpose(0, 1)
    q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
    q = q.view(s, heads, dim)
    if lw.q_norm is not None:
        q = rms_norm(q, lw.q_norm, cfg.norm_eps)
    q = apply_rope(q.transpose(0, 1), cos, sin)
    k, v = _heads_k_v(model, layer, k, v, cos, sin)
    return q, k, v


def project_qkv_storing(
    model: Model,
    layer: int,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
) -> torch.Tensor:
    """A decode row's q, its K/V row stored: h [1, H] with its RoPE cos/sin [1, rotary_dim]
    → q [Hq, 1, D]; k and v go into the layer's cache keys, values [Hkv, C, D] (contiguous,
    the model's dtype) at row `position` ([1] int64 on the device, read there). Where the
    kernels run a plain QKV product (no q/k norm), one launch does the norm, product, RoPE and
    store; else the projection, then the store (one launch on CUDA)."""
    cfg, lw = model.config, model.weights.layers[layer]
    heads, kv_heads, dim = cfg.num_heads, cfg.kv_heads_of(layer), cfg.head_dim_of(layer)
    q_dim = cfg.q_dim_of(layer)
    blocks = lw.blocks.get("wqkv")
    plain = lw.q_norm is None and lw.k_norm is None
    on_cpu_extension = blocks is not None and takes_fused(h, blocks)  # `project_qkv_with_rope`'s
    if plain and not on_cpu_extension and keys.dtype == h.dtype:
        cache = (keys, values, position)
        rotated = normed_linear_rope(
            h, lw.attn_norm, cfg.norm_eps, lw.wqkv, lw.bqkv, cos, sin, heads + kv_heads, dim, cache
        )
        if rotated is not None:
            return rotated[:, :q_dim].view(1, heads, dim).transpose(0, 1)
    q, k, v = project_qkv_with_rope(model, layer, h, cos, sin)
    if (row_kernels := elementwise_kernels(k)) is not None:
        row_kernels.store_row(keys, values, k, v, position)
    else:
        keys.index_copy_(1, position, k)
        values.index_copy_(1, position, v)
    return q


def project_q(model: Model, layer: int, h: torch.Tensor, start: int) -> torch.Tensor:
    """The queries alone of a layer sharing another's K/V: h [S, H] at positions start.. →
    q [Hq, S, D] (normed, q-normed, rotated, as `project_qkv` gives them)."""
    cos, sin = rope_table(model, layer).slice(start, h.shape[0])
    return project_q_with_rope(model, layer, h, cos, sin)


def project_q_with_rope(
    model: Model, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """`project_q` with the rows' RoPE cos/sin [S, rotary_dim] given."""
    cfg, lw = model.config, model.weights.layers[layer]
    blocks = lw.blocks.get("wqkv")
    q = normed_linear(h, lw.attn_norm, cfg.norm_eps, lw.wqkv, lw.bqkv, blocks)  # [S, q_dim]
    q = q.view(h.shape[0], cfg.num_heads, cfg.head_dim_of(layer))
    if lw.q_norm is not None:
        q = rms_norm(q, lw.q_norm, cfg.norm_eps)
    return apply_rope(q.transpose(0, 1), cos, sin)


def recompute_kv(
    model: Model, layer: int, h_stored: torch.Tensor, abs_start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of stored pre-layer residuals h_stored: [N, H] at positions abs_start.. →
    k, v: [Hkv, N, D], equal to what `attention_block` cached for the same rows."""
    cfg = model.config
    lw = model.weights.layers[layer]
    x = rms_norm(h_stored, lw.attn_norm, cfg.norm_eps)
    q_dim, kv_dim = cfg.q_dim_of(layer), cfg.kv_dim_of(layer)
    w_kv = lw.wqkv[q_dim:]
    b_kv = lw.bqkv[q_dim:] if lw.bqkv is not None else None
    k, v = linear(x, w_kv, b_kv).split([kv_dim, kv_dim], dim=-1)  # [N, kv_dim] each
    cos, sin = rope_table(model, layer).slice(abs_start, h_stored.shape[0])
    return _heads_k_v(model, layer, k, v, cos, sin)


def attend(
    model: Model,
    layer: int,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    window: int | None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [Hq, S, D] at positions start..start+S-1; keys/values: [Hkv, T, D] at the contiguous
    positions ending at start+S-1 → attention output [S, Hq·D] (= [S, q_dim] for the model's own
    head width). A query at position i sees key j iff j ≤ i and i − j < window, and, when an
    engine restricts it further, `allowed` [S, T] (bool, over the same keys) says so."""
    cfg = model.config
    s, t = q.shape[1], keys.shape[1]
    w = effective_window(model, layer, window)
    if w is not None and t > w + s - 1:  # keys no query can reach
        keys, values = keys[:, t - (w + s - 1) :], values[:, t - (w + s - 1) :]
        if allowed is not None:
            allowed = allowed[:, t - (w + s - 1) :]
        t = keys.shape[1]
    mask = None
    causal = False
    if s > 1 or (w is not None and t > w) or allowed is not None:
        if t == s and w is None and allowed is None:
            causal = True
        elif s > 1 and q.shape[0] * s * t > MASKED_SCORES_LIMIT:
            return _attend_in_blocks(model, layer, q, keys, values, start, window, w, allowed)
        else:
            q_pos = torch.arange(start, start + s, device=q.device).unsqueeze(1)  # [S, 1]
            k_pos = torch.arange(start + s - t, start + s, device=q.device).unsqueeze(0)  # [1, T]
            mask = k_pos <= q_pos
            if w is not None:
                mask &= (q_pos - k_pos) < w  # [S, T]
            if allowed is not None:
                mask &= allowed
    sinks = model.weights.layers[layer].attn_sinks
    if cfg.arch.attn_softcap is not None or sinks is not None:
        out = _eager_attention(
            q, keys, values, mask, causal, cfg.attn_scale, cfg.arch.attn_softcap, sinks
        )
    elif (
        s == 1
        and mask is None
        and takes_fused_attention(q, keys, values)
        and (kernels := cpu_extension()) is not None
    ):
        ran(FUSED_PIECES)
        return kernels.decode_attention(q.contiguous(), keys, values, cfg.attn_scale)  # [1, q_dim]
    elif s == 1 and mask is None and q.device.type == "cpu" and q.dtype in LOW_PRECISION:
        out = _decode_attention_float32(q, keys, values, cfg.attn_scale)
    elif q.device.type == "cuda":
        # Shapes here change from call to call (a decode query meets a new key length every
        # step; no-cache re-reads a longer prompt), and cuDNN's attention builds an execution
        # plan per new shape: ~2 ms of host time per step on an H200 host, 5-7x the rest of an
        # eager step. The other fused backends plan nothing.
        with sdpa_kernel(_VARYING_SHAPE_BACKENDS):
            out = _sdpa(model, q, keys, values, mask, causal)
    else:
        out = _sdpa(model, q, keys, values, mask, causal)
    return out.transpose(0, 1).reshape(s, -1)  # [S, Hq·D] (D: the width q and keys came in)


def _attend_in_blocks(
    model: Model,
    layer: int,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    window: int | None,
    w: int | None,
    allowed: torch.Tensor | None,
) -> torch.Tensor:
    """`attend` a block of queries at a time, each block over the keys its queries can reach
    (none after its last query; none a window before its first), so that no block's scores
    pass `MASKED_SCORES_LIMIT`. Arguments as `attend`'s (`w` the layer's effective window).
    → [S, q_dim]"""
    heads, s, _ = q.shape
    t = keys.shape[1]
    block = max(1, MASKED_SCORES_LIMIT // (heads * t))
    outputs = []
    for first in range(0, s, block):
        end = min(s, first + block)
        key_end = end + t - s  # the key of the block's last query's position, + 1
        key_first = 0 if w is None else max(0, key_end - (w + end - first - 1))
        outputs.append(
            attend(
                model,
                layer,
                q[:, first:end],
                keys[:, key_first:key_end],
                values[:, key_first:key_end],
                start + first,
                window,
                None if allowed is None else allowed[first:end, key_first:key_end],
            )
        )
    return torch.cat(outputs)  # [S, q_dim]


def static_mask(capacity: int, position: torch.Tensor, window: int | None) -> torch.Tensor:
    """Keys a decode query at `position` (a [1] long tensor on the device) may see in a
    fixed-capacity cache whose row i holds position i: i ≤ position and position − i < window.
    → [1, capacity] bool, computed on the device (so a captured graph recomputes it)."""
    rows = torch.arange(capacity, device=position.device)  # [C]
    valid = rows <= position
    if window is not None:
        valid &= (position - rows) < window
    return valid.view(1, capacity)


def attend_static(
    model: Model,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode query q: [Hq, 1, D] over a fixed-capacity cache keys/values: [Hkv, C, D]
    with `mask` [1, C] from `static_mask` (built with this layer's `effective_window`); `sinks`
    the layer's attention sinks [Hq] where it has them. Every shape is static, so the step can
    be captured in a CUDA graph. → [1, q_dim]"""
    cfg = model.config
    if cfg.arch.attn_softcap is not None or sinks is not None:
        cap = cfg.arch.attn_softcap
        out = _eager_attention(q, keys, values, mask, False, cfg.attn_scale, cap, sinks)
    else:
        out = _sdpa(model, q, keys, values, mask, causal=False)
    return out.transpose(0, 1).reshape(1, -1)


def attend_static_kernel(
    model: Model,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    window: int | None,
    kernel: DecodeAttention,
) -> torch.Tensor:
    """`attend_static` through a decode-attention kernel (`larql.kernels`) that reads the
    position from the device and skips the rows past it instead of masking a whole-capacity
    product; `window` is this layer's `effective_window`. → [1, q_dim]"""
    cfg = model.config
    softcap = cfg.arch.attn_softcap or 0.0
    out = kernel(q, keys, values, position, cfg.attn_scale, window or 0, softcap)  # [Hq, 1, D]
    return out.reshape(1, -1)


def _sdpa(
    model: Model,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor:
    """torch's fused attention, K/V heads shared by query groups: → [Hq, S, D]."""
    cfg = model.config
    if q.device.type == "meta":  # `larql memory`: the shape and dtype, without torch's meta rules
        return q.new_empty(q.shape[0], q.shape[1], values.shape[-1])
    return F.scaled_dot_product_attention(
        q.unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=cfg.attn_scale,
        enable_gqa=q.shape[0] != keys.shape[0],
    )[0]


def _decode_attention_float32(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    # SDPA's CPU kernels in bfloat16/float16 take 4-7x longer for one query than this float32
    # product (grouped per K/V head, so K/V are not repeated): q [Hq, 1, D] → [Hq, 1, D].
    heads, _, dim = q.shape
    kv_heads = keys.shape[0]
    grouped = q.reshape(kv_heads, heads // kv_heads, dim).float()  # [Hkv, g, D]
    scores = torch.bmm(grouped, keys.float().transpose(1, 2)) * scale  # [Hkv, g, T]
    out = torch.bmm(torch.softmax(scores, dim=-1), values.float())  # [Hkv, g, D]
    return out.to(q.dtype).reshape(heads, 1, dim)


def _eager_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    cap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """What SDPA cannot do: a soft-cap, scores = cap·tanh(q·k·scale / cap) before the mask and
    softmax (Gemma 2), and attention sinks, a logit per query head [Hq] in the softmax beside
    the keys' whose weight goes to no value (GPT-OSS). → [Hq, S, D]"""
    group = q.shape[0] // keys.shape[0]
    keys = keys.repeat_interleave(group, dim=0)  # [Hq, T, D]
    values = values.repeat_interleave(group, dim=0)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [Hq, S, T]
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if causal:
        s, t = scores.shape[-2:]
        mask = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    wide = torch.promote_types(scores.dtype, torch.float32)  # float64 stays float64
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=wide).to(q.dtype)
    else:
        sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, scores.shape[1], 1)  # [Hq, S, 1]
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=wide)
        probs = probs[..., :-1].to(q.dtype)  # the sink's share goes nowhere
    return torch.matmul(probs, values)


def attention_block(
    model: Model,
    layer: int,
    h: torch.Tensor,
    start: int,
    kv: KvSink,
    window: int | None = None,
    allowed: torch.Tensor | None = None,
    shared: SharedKv | None = None,
    queries: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Pre-layer residual h: [S, H] at positions start.. → residual after attention [S, H].
    The new rows' K (k-normed, rotated) and V go to `kv`; `allowed` as in `attend`. On a model
    sharing K/V across layers, `shared` carries what each source layer attended over to the
    layers that share it (which project queries alone and leave `kv` empty). `queries`, where
    given, receives the queries it attended with, q [Hq, S, D] (normed, rotated)."""
    if shared is not None and shares(model.config, layer):
        keys, values, allowed = shared.of(layer)
        q = project_q(model, layer, h, start)
    else:
        q, k, v = project_qkv(model, layer, h, start)
        keys, values = kv.append(k, v)
        if shared is not None:
            shared.keep(layer, keys, values, allowed)
    if queries is not None:
        queries.append(q)
    attn = attend(model, layer, q, keys, values, start, window, allowed)  # [S, q_dim]
    return attention_output(model, layer, h, attn)


def attention_output(model: Model, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Output projection (+ post-attention norm) added to the residual: [S, H]."""
    lw = model.weights.layers[layer]
    blocks = lw.blocks.get("wo")
    if model.shard is not None:
        # this rank's heads' share of the projection, summed over the ranks, then the bias,
        # norm and residual add every rank applies to the same sum
        out = model.shard.all_reduce(linear(attn, lw.wo, None, blocks))  # [S, H]
        if lw.bo is not None:
            out = out + lw.bo
        if lw.post_attn_norm is not None:
            out = rms_norm(out, lw.post_attn_norm, model.config.norm_eps)
        return h + out
    fused = lw.post_attn_norm is None and blocks is not None and takes_fused(h, blocks)
    kernels = cpu_extension() if fused else None
    if kernels is not None:
        ran(FUSED_PIECES)
        attn = attn.contiguous()
        return kernels.residual_gemv(
            h.contiguous(), attn, *kernel_rows(blocks, kernels), lw.bo, activation_bits(blocks)
        )
    if lw.post_attn_norm is None:
        return residual_linear(h, attn, lw.wo, lw.bo, blocks)
    out = rms_norm(linear(attn, lw.wo, lw.bo, blocks), lw.post_attn_norm, model.config.norm_eps)
    return h + out


def ffn_block(
    model: Model,
    layer: int,
    h: torch.Tensor,
    ffn: FfnBackend,
    inputs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Residual after attention h: [S, H] → the layer's output residual [S, H]: the FFN, then
    (Gemma 4) the rows' per-layer `inputs` [S, L, P] (`per_layer_inputs`) and the layer
    scalar."""
    if model.weights.layers[layer].per_layer_gate is not None:
        return _per_layer_input(model, layer, _ffn_residual(model, layer, h, ffn), inputs)
    return _ffn_residual(model, layer, h, ffn)


def _per_layer_input(
    model: Model, layer: int, h: torch.Tensor, inputs: torch.Tensor | None
) -> torch.Tensor:
    """h + norm(W_proj · (act(W_gate · h) ⊙ the layer's input)), × the layer scalar: [S, H]."""
    if inputs is None:
        raise InvariantViolation(
            f"layer {layer} takes per-layer inputs and none were passed (`per_layer_inputs`)"
        )
    lw = model.weights.layers[layer]
    assert lw.per_layer_gate is not None and lw.per_layer_projection is not None
    assert lw.per_layer_post_norm is not None
    gate = gated_activation(linear(h, lw.per_layer_gate), model.config.arch.activation)  # [S, P]
    out = linear(gate * inputs[:, layer], lw.per_layer_projection)  # [S, H]
    h = h + rms_norm(out, lw.per_layer_post_norm, model.config.norm_eps)
    return h * lw.layer_scalar if lw.layer_scalar is not None else h


def _ffn_residual(model: Model, layer: int, h: torch.Tensor, ffn: FfnBackend) -> torch.Tensor:
    """The FFN's half of `ffn_block` (with the layer scalar, unless per-layer inputs follow)."""
    lw = model.weights.layers[layer]
    eps = model.config.norm_eps
    plain = lw.post_ffn_norm is None and lw.layer_scalar is None and model.shard is None
    fused = ffn.fused_block(layer, h, lw.ffn_norm, eps) if plain else None
    if fused is not None:
        return fused
    out = ffn.forward(layer, rms_norm(h, lw.ffn_norm, eps))
    routed = ffn.parallel_experts(layer, h) if lw.experts_norm is not None else None  # [S, H]
    if model.shard is not None:  # this rank's share of the MLP's (and experts') units, summed
        if routed is None:
            out = model.shard.all_reduce(out)  # [S, H]
        else:  # both partial sums in one all-reduce
            out, routed = model.shard.all_reduce(torch.cat([out, routed], dim=-1)).chunk(2, -1)
    if routed is not None:  # experts beside the MLP: each output normed, then summed
        assert lw.post_mlp_norm is not None and lw.post_experts_norm is not None
        routed = rms_norm(routed, lw.post_experts_norm, eps)
        out = rms_norm(out, lw.post_mlp_norm, eps) + routed
    if lw.post_ffn_norm is not None:
        out = rms_norm(out, lw.post_ffn_norm, eps)
    if lw.layer_scalar is not None and lw.per_layer_gate is None:
        return (h + out) * lw.layer_scalar
    return h + out


def layer_step(
    model: Model,
    layer: int,
    h: torch.Tensor,
    start: int,
    kv: KvSink,
    ffn: FfnBackend,
    window: int | None = None,
    inputs: torch.Tensor | None = None,
    shared: SharedKv | None = None,
) -> torch.Tensor:
    """One whole layer: attention (K/V into `kv`; `shared` as `attention_block`) then FFN
    (`inputs`: the rows' per-layer inputs, as `ffn_block`). h: [S, H] → [S, H]."""
    h = attention_block(model, layer, h, start, kv, window, shared=shared)
    return ffn_block(model, layer, h, ffn, inputs)


class RowAttention(Protocol):
    """Session i's attention for its rows: q [Hq, n, D], its new k, v [Hkv, n, D] (which the
    session keeps; n = 1 for a decode row, more for a prompt's chunk, causal) → [n, q_dim].
    On a layer sharing another's K/V, k and v are None: the session attends over what its
    source layer attended over in this step."""

    def __call__(
        self, i: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor: ...


def batched_layer_step(
    model: Model,
    layer: int,
    h: torch.Tensor,
    positions: list[int],
    attend_row: RowAttention,
    ffn: FfnBackend,
    inputs: torch.Tensor | None = None,
    counts: Sequence[int] | None = None,
) -> torch.Tensor:
    """One layer for the rows of B sessions at once: session i's rows (one, a decode row, or
    counts[i] of them, consecutive) are its tokens at `positions` (one per row) and attend
    through `attend_row(i, …)` over that session's state only. The projections and the FFN
    run once over all rows (one matrix product instead of B); attention runs per session.
    h: [R, H] → [R, H]."""
    cos, sin = rope_table(model, layer).rows(positions)  # [R, rotary] each
    ends = list(itertools.accumulate(counts if counts is not None else [1] * h.shape[0]))
    spans = [slice(end - n, end) for end, n in zip(ends, counts or [1] * len(ends), strict=True)]
    if shares(model.config, layer):
        q = project_q_with_rope(model, layer, h, cos, sin)  # [Hq, R, D]
        attn = torch.cat([attend_row(i, q[:, r], None, None) for i, r in enumerate(spans)])
    else:
        q, k, v = project_qkv_with_rope(model, layer, h, cos, sin)  # [Hq, R, D], [Hkv, R, D] ×2
        attn = torch.cat([attend_row(i, q[:, r], k[:, r], v[:, r]) for i, r in enumerate(spans)])
    return ffn_block(model, layer, attention_output(model, layer, h, attn), ffn, inputs)  # [R, H]


def final_logits(model: Model, h: torch.Tensor) -> torch.Tensor:
    """Pre-final-norm hidden h: [S, H] → logits [S, V] (final norm, LM head, soft-cap)."""
    w, eps = model.weights, model.config.norm_eps
    logits = normed_linear(h, w.final_norm, eps, w.lm_head, blocks=w.lm_head_blocks)  # [S, V]
    cap = model.config.arch.final_softcap
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits
