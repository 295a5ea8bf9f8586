"""GGUF → (`ModelConfig`, canonical state dict) for the architectures of `larql.models.archs`
that name a GGUF architecture (llama, qwen2, qwen3, phi3, gemma3, the mixtures of experts
qwen2moe, qwen3moe and gpt-oss, granite).

Layout facts handled here (checked against transformers' own GGUF loader):
- llama.cpp permutes llama Q/K rows for its interleaved RoPE; we un-permute to the split-half
  layout every other architecture uses (`gguf_interleaved_qk`).
- Gemma norms are stored as (1 + w) already: that is the multiplier we keep.
- Which layers slide is the preset's rule (Gemma 3: every 6th layer is global); sliding layers
  take `<arch>.attention.sliding_window` keys and the preset's sliding RoPE base (not in the
  file).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from larql.models.archs import preset_for_gguf
from larql.models.blocks import GGUF_FORMATS, BlockRows, block_width
from larql.models.config import ExpertRouting, LayerSpec, ModelConfig, RopeSpec
from larql.models.errors import ModelFormatError, UnsupportedArchitecture
from larql.models.gguf_file import GgufFile
from larql.models.multipliers import (
    INTO_RESIDUAL,
    fold_multipliers,
    folds_residual,
    multiplier_folds,
)
from larql.models.rope import yarn_attention_factor

_LAYER_TENSORS = {
    "attn_norm": "attn_norm",
    "attn_q": "wq",
    "attn_k": "wk",
    "attn_v": "wv",
    "attn_output": "wo",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "post_attention_norm": "post_attn_norm",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "w_gate",
    "ffn_up": "w_up",
    "ffn_down": "w_down",
    "post_ffw_norm": "post_ffn_norm",
    # mixture-of-experts blocks (Mixtral as llama, qwen2moe, qwen3moe): experts stacked [E, …]
    "ffn_gate_inp": "router",
    "ffn_gate_exps": "experts_gate",
    "ffn_up_exps": "experts_up",
    "ffn_down_exps": "experts_down",
    "ffn_gate_shexp": "shared_gate",
    "ffn_up_shexp": "shared_up",
    "ffn_down_shexp": "shared_down",
    "ffn_gate_inp_shexp": "shared_expert_gate",
    "attn_sinks": "attn_sinks",  # GPT-OSS: one learned sink logit per query head
}
_BIASES = {
    "attn_q": "bq",
    "attn_k": "bk",
    "attn_v": "bv",
    "attn_output": "bo",
    # GPT-OSS: the router's and the experts' biases
    "ffn_gate_inp": "router_bias",
    "ffn_gate_exps": "experts_gate_bias",
    "ffn_up_exps": "experts_up_bias",
    "ffn_down_exps": "experts_down_bias",
}
# A fused matrix → its canonical parts in row order, each with its row count.
_FUSED: dict[str, Callable[[ModelConfig], tuple[tuple[str, int], ...]]] = {
    "attn_qkv": lambda c: (("wq", c.q_dim), ("wk", c.kv_dim), ("wv", c.kv_dim)),
    "ffn_up": lambda c: (("w_gate", c.intermediate_size), ("w_up", c.intermediate_size)),
}
# (canonical name, rows of the stored tensor it takes)
Part = tuple[str, slice]


def gguf_config(gguf: GgufFile, name: str = "") -> ModelConfig:
    preset = preset_for_gguf(gguf.architecture)
    hidden = int(gguf.arch_key("embedding_length"))
    heads = int(gguf.arch_key("attention.head_count"))
    kv_heads = int(gguf.arch_key("attention.head_count_kv", heads))
    head_dim = int(gguf.arch_key("attention.key_length", hidden // heads))
    num_layers = int(gguf.arch_key("block_count"))
    rope = _rope_spec(gguf, head_dim)
    tokens = gguf.get("tokenizer.ggml.tokens", [])
    vocab = int(
        gguf.arch_key("vocab_size", len(tokens) or gguf.tensors["token_embd.weight"].shape[0])
    )
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(gguf.arch_key("feed_forward_length")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_positions=int(gguf.arch_key("context_length", 2048)),
        norm_eps=float(gguf.arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
        attn_scale=head_dim**-0.5,
        tie_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=_opt_int(gguf.get("tokenizer.ggml.bos_token_id")),
        eos_token_ids=_eos_ids(gguf),
        name=name or str(gguf.get("general.name", gguf.path.stem)),
    )
    window = _opt_int(gguf.arch_key("attention.sliding_window"))
    sliding = preset.sliding_layers({"sliding_window": window}, num_layers)
    base = preset.sliding_rope_base
    local = rope if base is None else RopeSpec(base=base, rotary_dim=rope.rotary_dim)
    layers = tuple(
        LayerSpec(window, local) if slides and window else LayerSpec(None, rope)
        for slides in sliding
    )
    # Granite's multipliers (1 elsewhere): llama.cpp divides the logits by `logit_scale`
    residual = float(gguf.arch_key("residual_scale", 1.0))
    logits_divisor = float(gguf.arch_key("logit_scale", 1.0))
    common["attn_scale"] = float(gguf.arch_key("attention.scale", 0.0)) or head_dim**-0.5
    return ModelConfig(
        arch=preset.arch,
        layers=layers,
        experts=_expert_routing(gguf),
        embedding_multiplier=float(gguf.arch_key("embedding_scale", 1.0)),
        extra=multiplier_folds(residual, logits_divisor, preset.arch),
        **common,
    )


def _expert_routing(gguf: GgufFile) -> ExpertRouting | None:
    count = _opt_int(gguf.arch_key("expert_count"))
    if not count:
        return None
    preset = preset_for_gguf(gguf.architecture)
    try:
        return ExpertRouting(
            int(count),
            int(gguf.arch_key("expert_used_count", 0)),
            bool(gguf.arch_key("expert_weights_norm", preset.gguf_experts_normalized)),
            clamped_swiglu=preset.gguf_clamped_swiglu,
        )
    except ValueError as e:
        raise ModelFormatError(f"{gguf.path}: bad mixture-of-experts settings: {e}") from e


def gguf_state_dict(
    gguf: GgufFile, config: ModelConfig, progress: Callable[[int, int], None] | None = None
) -> dict[str, torch.Tensor]:
    """Dequantize every tensor into the canonical layout (float32)."""
    state: dict[str, torch.Tensor] = {}
    preset = preset_for_gguf(gguf.architecture)
    interleaved_qk, renamed = preset.gguf_interleaved_qk, preset.gguf_renamed or {}
    names = list(gguf.tensors)
    for n, gguf_name in enumerate(names):
        parts = _canonical_parts(gguf_name, gguf.tensors[gguf_name].shape, config, renamed)
        whole = gguf.dequantize(gguf_name) if parts else None
        for canonical, rows in parts:
            array = whole[rows]  # type: ignore[index]
            if interleaved_qk and canonical.endswith((".wq", ".wk")):
                n_head = config.num_heads if canonical.endswith(".wq") else config.num_kv_heads
                array = _unpermute_rows(array, n_head)
            if canonical.endswith(".shared_expert_gate"):
                array = array.reshape(1, -1)  # llama.cpp keeps the gate's one row as [H]
            state[canonical] = torch.from_numpy(np.ascontiguousarray(array))
        if progress is not None:
            progress(n + 1, len(names))
    fold_multipliers(state, config)
    return state


def gguf_block_rows(gguf: GgufFile, config: ModelConfig) -> dict[str, BlockRows]:
    """The matrices stored in a block format the CPU kernels read (Q8_0, Q4_0, Q4_1, Q4_K), as
    `BlockRows` under their canonical names, rows in the canonical order; others are absent, and
    so are the ones a multiplier is folded into at load (their blocks are not the weights)."""
    blocks: dict[str, BlockRows] = {}
    scaled = INTO_RESIDUAL if folds_residual(config) else ()
    preset = preset_for_gguf(gguf.architecture)
    interleaved_qk, renamed = preset.gguf_interleaved_qk, preset.gguf_renamed or {}
    for gguf_name, info in gguf.tensors.items():
        width = info.shape[1] if len(info.shape) == 2 else 0
        if info.qtype not in GGUF_FORMATS or not width or width % block_width(info.qtype):
            continue
        parts = [p for p in _canonical_parts(gguf_name, info.shape, config, renamed)
                 if p[0].rsplit(".", 1)[-1] not in scaled]  # fmt: skip
        if not parts:
            continue
        whole = BlockRows.from_gguf(info.qtype, gguf.raw_bytes(gguf_name), info.shape)
        for canonical, part in parts:
            order = np.arange(info.shape[0])[part]  # [rows of this part]
            if interleaved_qk and canonical.endswith((".wq", ".wk")):
                n_head = config.num_heads if canonical.endswith(".wq") else config.num_kv_heads
                order = _unpermute_rows(order[:, None], n_head)[:, 0]
            if len(order) == info.shape[0] and (order == np.arange(len(order))).all():
                blocks[canonical] = whole  # type: ignore[assignment]
            else:
                index = torch.from_numpy(np.ascontiguousarray(order))
                blocks[canonical] = whole.take_rows(index)  # type: ignore[union-attr]
    return blocks


def _canonical_parts(
    gguf_name: str, shape: tuple[int, ...], config: ModelConfig, renamed: Mapping[str, str]
) -> list[Part]:
    """The canonical tensors one GGUF tensor holds: one, several for a fused matrix (recognised
    by its row count), none for what is read into the config instead."""
    parts = gguf_name.split(".")
    fused = _FUSED.get(parts[2]) if len(parts) == 4 and parts[3] == "weight" else None
    if fused is not None:
        sizes = fused(config)  # an unfused ffn_up has half these rows
        if shape[0] == sum(rows for _, rows in sizes):
            out, start = [], 0
            for name, rows in sizes:
                out.append((f"layers.{parts[1]}.{name}", slice(start, start + rows)))
                start += rows
            return out
    canonical = _canonical_name(gguf_name, renamed)
    return [] if canonical is None else [(canonical, slice(None))]


def _canonical_name(gguf_name: str, renamed: Mapping[str, str]) -> str | None:
    if gguf_name == "token_embd.weight":
        return "embed"
    if gguf_name == "output.weight":
        return "lm_head"
    if gguf_name == "output_norm.weight":
        return "final_norm"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk":
        _, layer, kind, suffix = parts
        if suffix == "weight" and kind in renamed:
            return f"layers.{layer}.{renamed[kind]}"
        if suffix == "weight" and kind in _LAYER_TENSORS:
            return f"layers.{layer}.{_LAYER_TENSORS[kind]}"
        if suffix == "bias" and kind in _BIASES:
            return f"layers.{layer}.{_BIASES[kind]}"
    return None  # rope_freqs and friends are read into the config, not the state


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp interleaves each head's rotary pairs; restore the split-half row order.
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _rope_spec(gguf: GgufFile, head_dim: int) -> RopeSpec:
    base = float(gguf.arch_key("rope.freq_base", 10_000.0))
    rotary_dim = int(gguf.arch_key("rope.dimension_count", head_dim))
    scaling_type = str(gguf.arch_key("rope.scaling.type", "none"))
    if "rope_factors_long.weight" in gguf.tensors:
        raise UnsupportedArchitecture(
            f"{gguf.path.name}: long/short RoPE factor tensors (Phi-3 LongRoPE) are not "
            "supported from GGUF (supported: linear, yarn)"
        )
    divisors = None
    if "rope_freqs.weight" in gguf.tensors:
        divisors = tuple(float(x) for x in gguf.dequantize("rope_freqs.weight").reshape(-1))
    if scaling_type in ("none", ""):
        return RopeSpec(base=base, rotary_dim=rotary_dim, freq_divisors=divisors)
    if scaling_type == "linear":
        factor = float(gguf.arch_key("rope.scaling.factor", 1.0))
        return RopeSpec(base, rotary_dim, "linear", factor, freq_divisors=divisors)
    if scaling_type == "yarn":
        return _yarn_spec(gguf, base, rotary_dim, divisors)
    raise UnsupportedArchitecture(
        f"RoPE scaling {scaling_type!r} in {gguf.path.name} is not supported "
        "(supported: linear, yarn)"
    )


def _yarn_spec(
    gguf: GgufFile, base: float, rotary_dim: int, divisors: tuple[float, ...] | None
) -> RopeSpec:
    """llama.cpp's YaRN keys: the factor, the pretraining context, optional ramp bounds. Its
    attention factor is YaRN's default (0.1·ln(factor) + 1); files that change it (an
    `attn_factor` or a `yarn_log_multiplier`, DeepSeek's mscale) are refused, not guessed."""
    for key, neutral in (
        ("rope.scaling.attn_factor", 1.0),
        ("rope.scaling.yarn_log_multiplier", 0.0),
    ):
        value = gguf.arch_key(key)
        if value is not None and float(value) != neutral:
            raise UnsupportedArchitecture(
                f"YaRN with {gguf.architecture}.{key} = {value} in {gguf.path.name} is not "
                "supported (only the default attention factor)"
            )
    factor = float(gguf.arch_key("rope.scaling.factor", 1.0))
    context = gguf.arch_key("rope.scaling.original_context_length")
    if context is None:
        raise ModelFormatError(
            f"{gguf.path.name}: YaRN scaling without {gguf.architecture}."
            "rope.scaling.original_context_length"
        )
    return RopeSpec(
        base,
        rotary_dim,
        "yarn",
        factor,
        original_max_positions=int(context),
        freq_divisors=divisors,
        attention_factor=yarn_attention_factor(factor),
        beta_fast=float(gguf.arch_key("rope.scaling.yarn_beta_fast") or 32.0),
        beta_slow=float(gguf.arch_key("rope.scaling.yarn_beta_slow") or 1.0),
    )


def _eos_ids(gguf: GgufFile) -> tuple[int, ...]:
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = _opt_int(gguf.get(key))
        if value is not None and value not in ids:
            ids.append(value)
    return tuple(ids)


def _opt_int(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[arg-type]
