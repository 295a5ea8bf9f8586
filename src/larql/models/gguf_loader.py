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

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from larql.models.archs import preset_for_gguf
from larql.models.blocks import GGUF_FORMATS, BlockRows, block_width
from larql.models.config import ExpertRouting, LayerSpec, ModelConfig, RopeSpec
from larql.models.errors import ModelFormatError, UnsupportedArchitecture
from larql.models.fields import (
    MAX_CONTEXT,
    MAX_EXPERTS,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_VOCAB,
    MAX_WIDTH,
    Fields,
    show,
)
from larql.models.gguf_file import GgufFile
from larql.models.multipliers import (
    INTO_RESIDUAL,
    fold_multipliers,
    folds_residual,
    multiplier_folds,
)
from larql.models.rope import check_rope, yarn_attention_factor
from larql.models.weights import expected_shape

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
    """The model's config from the file's metadata, every size typed and bounded, and checked
    against the tensor table (nothing is dequantized for that)."""
    preset = preset_for_gguf(gguf.architecture)
    keys = arch_fields(gguf)
    hidden = keys.integer("embedding_length", low=1, high=MAX_WIDTH)
    heads = keys.integer("attention.head_count", low=1, high=MAX_HEADS)
    kv_heads = keys.integer("attention.head_count_kv", heads, low=1, high=heads)
    head_dim = keys.integer("attention.key_length", hidden // heads, low=1, high=MAX_HEAD_DIM)
    num_layers = keys.integer("block_count", low=1, high=MAX_LAYERS)
    rope = _rope_spec(gguf, head_dim)
    check_rope(rope, head_dim)
    vocab = keys.integer("vocab_size", _vocab_size(gguf), low=1, high=MAX_VOCAB)
    window = keys.optional_integer("attention.sliding_window", high=MAX_CONTEXT)
    sliding = preset.sliding_layers({"sliding_window": window}, num_layers)
    base = preset.sliding_rope_base
    local = rope if base is None else RopeSpec(base=base, rotary_dim=rope.rotary_dim)
    layers = tuple(
        LayerSpec(window, local) if slides and window else LayerSpec(None, rope)
        for slides in sliding
    )
    # Granite's multipliers (1 elsewhere): llama.cpp divides the logits by `logit_scale`
    residual = keys.number("residual_scale", 1.0)
    logits_divisor = keys.number("logit_scale", 1.0, positive=True)
    try:
        config = ModelConfig(
            arch=preset.arch,
            layers=layers,
            experts=_expert_routing(gguf, keys),
            embedding_multiplier=keys.number("embedding_scale", 1.0),
            extra=multiplier_folds(residual, logits_divisor, preset.arch),
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=keys.integer("feed_forward_length", low=1, high=MAX_WIDTH),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_positions=keys.integer("context_length", 2048, low=1, high=MAX_CONTEXT),
            norm_eps=keys.number("attention.layer_norm_rms_epsilon", 1e-5),
            attn_scale=keys.number("attention.scale", 0.0) or head_dim**-0.5,
            tie_embeddings="output.weight" not in gguf.tensors,
            bos_token_id=_token_id(gguf, "bos_token_id", vocab),
            eos_token_ids=_eos_ids(gguf, vocab),
            name=name or str(gguf.get("general.name", gguf.path.stem)),
        )
    except ValueError as e:
        raise ModelFormatError(f"inconsistent attention settings: {e}") from None
    check_tensor_table(gguf, config)
    return config


class _ArchKeys:
    """The `{architecture}.` keys of a file, by their suffix."""

    def __init__(self, gguf: GgufFile) -> None:
        self.gguf = gguf

    def get(self, suffix: str, default: Any = None, /) -> Any:
        return self.gguf.arch_key(suffix, default)


def arch_fields(gguf: GgufFile) -> Fields:
    """Typed reads of the file's `{architecture}.` keys (`block_count`, …)."""
    return Fields(_ArchKeys(gguf), f"{gguf.architecture}.")


def _vocab_size(gguf: GgufFile) -> int:
    """Where the file has no `vocab_size`: its tokens, else its embedding's rows."""
    tokens = gguf.strings("tokenizer.ggml.tokens")
    if tokens:
        return len(tokens)
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelFormatError("no token_embd.weight and no vocabulary size")
    return embed.shape[0]


def check_tensor_table(gguf: GgufFile, config: ModelConfig) -> None:
    """Every tensor's shape against what `config` implies for it, every layer holding tensors
    and none beyond the last: from the tensor table alone, before anything is dequantized."""
    preset = preset_for_gguf(gguf.architecture)
    renamed = preset.gguf_renamed or {}
    layers_seen = set()
    for name, info in gguf.tensors.items():
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 2:
            if not parts[1].isdigit() or int(parts[1]) >= config.num_layers:
                raise ModelFormatError(
                    f"tensor {name} is outside the {config.num_layers} layers of "
                    f"{gguf.architecture}.block_count"
                )
            layers_seen.add(int(parts[1]))
        for canonical, rows in _canonical_parts(name, info.shape, config, renamed):
            shape = (len(range(info.shape[0])[rows]), *info.shape[1:])
            want = expected_shape(config, canonical)
            if want is not None and shape != want:
                raise ModelFormatError(
                    f"tensor {name} has shape {info.shape}; the metadata implies {want} "
                    f"for {canonical}"
                )
    missing = sorted(set(range(config.num_layers)) - layers_seen)
    if missing:
        raise ModelFormatError(
            f"{gguf.architecture}.block_count is {config.num_layers} but the file has no "
            f"tensors for layer {missing[0]}"
        )


def _expert_routing(gguf: GgufFile, keys: Fields) -> ExpertRouting | None:
    count = keys.optional_integer("expert_count", high=MAX_EXPERTS)
    if not count:
        return None
    preset = preset_for_gguf(gguf.architecture)
    try:
        return ExpertRouting(
            count,
            keys.integer("expert_used_count", 0),
            keys.flag("expert_weights_norm", preset.gguf_experts_normalized),
            clamped_swiglu=preset.gguf_clamped_swiglu,
            expert_width=_stored_width(gguf, "ffn_gate_exps"),
            shared_width=_stored_width(gguf, "ffn_gate_shexp") or 0,
        )
    except ValueError as e:
        raise ModelFormatError(f"bad mixture-of-experts settings: {e}") from None


def _stored_width(gguf: GgufFile, kind: str) -> int | None:
    """The intermediate width F of the first `blk.i.{kind}.weight` in the tensor table (the
    experts' [E, F, H], the shared expert's [F, H]), None where no layer has one."""
    for name, info in gguf.tensors.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] == kind and parts[3] == "weight":
            return int(info.shape[-2])
    return None


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


def gguf_shapes(gguf: GgufFile, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The canonical state's shapes (`gguf_state_dict`'s, tensor by tensor) from the tensor table
    alone: nothing is dequantized or read (`larql.models.structure`)."""
    renamed = preset_for_gguf(gguf.architecture).gguf_renamed or {}
    shapes: dict[str, tuple[int, ...]] = {}
    for gguf_name, info in gguf.tensors.items():
        for canonical, rows in _canonical_parts(gguf_name, info.shape, config, renamed):
            shape = (len(range(info.shape[0])[rows]), *info.shape[1:])
            if canonical.endswith(".shared_expert_gate"):
                shape = (1, math.prod(shape))  # as `gguf_state_dict` reshapes it
            shapes[canonical] = shape
    return shapes


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
        parts = [
            p
            for p in _canonical_parts(gguf_name, info.shape, config, renamed)
            if p[0].rsplit(".", 1)[-1] not in scaled
        ]
        if not parts:
            continue
        whole = BlockRows.from_gguf(info.qtype, gguf.raw_bytes(gguf_name), (info.shape[0], width))
        for canonical, part in parts:
            order = np.arange(info.shape[0])[part]  # [rows of this part]
            if interleaved_qk and canonical.endswith((".wq", ".wk")):
                n_head = config.num_heads if canonical.endswith(".wq") else config.num_kv_heads
                order = _unpermute_rows(order[:, None], n_head)[:, 0]
            if len(order) == info.shape[0] and (order == np.arange(len(order))).all():
                blocks[canonical] = whole
            else:
                index = torch.from_numpy(np.ascontiguousarray(order))
                blocks[canonical] = whole.take_rows(index)
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
    keys = arch_fields(gguf)
    base = keys.number("rope.freq_base", 10_000.0, positive=True)
    rotary_dim = keys.integer("rope.dimension_count", head_dim, low=2, high=head_dim)
    if rotary_dim % 2:
        raise ModelFormatError(f"{keys.prefix}rope.dimension_count {rotary_dim} is odd")
    scaling_type = keys.text("rope.scaling.type", "none")
    if "rope_factors_long.weight" in gguf.tensors:
        raise UnsupportedArchitecture(
            "long/short RoPE factor tensors (Phi-3 LongRoPE) are not supported from GGUF "
            "(supported: linear, yarn)"
        )
    divisors = None
    if "rope_freqs.weight" in gguf.tensors:
        shape = gguf.tensors["rope_freqs.weight"].shape
        if shape != (rotary_dim // 2,):
            raise ModelFormatError(
                f"tensor rope_freqs.weight has shape {shape}, expected ({rotary_dim // 2},) "
                "(rope.dimension_count / 2)"
            )
        divisors = tuple(float(x) for x in gguf.dequantize("rope_freqs.weight").reshape(-1))
    if scaling_type in ("none", ""):
        return RopeSpec(base=base, rotary_dim=rotary_dim, freq_divisors=divisors)
    if scaling_type == "linear":
        factor = keys.number("rope.scaling.factor", 1.0, positive=True)
        return RopeSpec(base, rotary_dim, "linear", factor, freq_divisors=divisors)
    if scaling_type == "yarn":
        return _yarn_spec(gguf, keys, base, rotary_dim, divisors)
    raise UnsupportedArchitecture(
        f"RoPE scaling {show(scaling_type)} is not supported (supported: linear, yarn)"
    )


def _yarn_spec(
    gguf: GgufFile, keys: Fields, base: float, rotary_dim: int, divisors: tuple[float, ...] | None
) -> RopeSpec:
    """llama.cpp's YaRN keys: the factor, the pretraining context, optional ramp bounds. Its
    attention factor is YaRN's default (0.1·ln(factor) + 1); files that change it (an
    `attn_factor` or a `yarn_log_multiplier`, DeepSeek's mscale) are refused, not guessed."""
    for key, neutral in (
        ("rope.scaling.attn_factor", 1.0),
        ("rope.scaling.yarn_log_multiplier", 0.0),
    ):
        value = keys.number(key, neutral)
        if value != neutral:
            raise UnsupportedArchitecture(
                f"YaRN with {keys.prefix}{key} = {value} is not supported (only the default "
                "attention factor)"
            )
    factor = keys.number("rope.scaling.factor", 1.0, positive=True)
    context = keys.integer("rope.scaling.original_context_length", low=1, high=MAX_CONTEXT)
    return RopeSpec(
        base,
        rotary_dim,
        "yarn",
        factor,
        original_max_positions=context,
        freq_divisors=divisors,
        attention_factor=yarn_attention_factor(factor),
        beta_fast=keys.number("rope.scaling.yarn_beta_fast", 0.0) or 32.0,
        beta_slow=keys.number("rope.scaling.yarn_beta_slow", 0.0) or 1.0,
    )


def _token_id(gguf: GgufFile, key: str, vocab: int) -> int | None:
    """`tokenizer.ggml.{key}`: a token id of the vocabulary, or None."""
    return Fields(gguf.metadata).optional_integer(f"tokenizer.ggml.{key}", high=vocab - 1)


def _eos_ids(gguf: GgufFile, vocab: int) -> tuple[int, ...]:
    ids = []
    for key in ("eos_token_id", "eot_token_id"):
        value = _token_id(gguf, key, vocab)
        if value is not None and value not in ids:
            ids.append(value)
    return tuple(ids)
