"""HF-format directories (config.json + *.safetensors + tokenizer.json) → (`ModelConfig`,
canonical state dict).

Each supported `model_type` is a row of `larql.models.archs`; the per-layer attention span and
RoPE come from the config the same way for all of them, in both the transformers 4 form
(`rope_theta`, `rope_scaling`, `sliding_window_pattern`) and the 5 form (`rope_parameters`,
`layer_types`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from larql.models.archs import ArchPreset, preset_for_hf
from larql.models.config import Arch, ExpertRouting, LayerSpec, ModelConfig, RopeSpec
from larql.models.errors import ModelFormatError, UnsupportedArchitecture
from larql.models.hf_rope import rope_context, rope_spec
from larql.models.multipliers import fold_multipliers, multiplier_folds
from larql.models.mxfp4 import dequantize_mxfp4

_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu": "gelu",
}
_WEIGHT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_LAYER_TENSORS = {
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "self_attn.o_proj.bias": "bo",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
    "input_layernorm.weight": "attn_norm",
    "layer_scalar": "layer_scalar",  # Gemma 4: the layer's output × this
    "per_layer_input_gate.weight": "per_layer_gate",  # Gemma 4's per-layer inputs
    "per_layer_projection.weight": "per_layer_projection",
    "post_per_layer_input_norm.weight": "per_layer_post_norm",
}
# Gemma 4's per-layer input table, the projection of the embedding into it, and its norm
_MODEL_TENSORS = {
    "embed_tokens.weight": "embed",
    "norm.weight": "final_norm",
    "embed_tokens_per_layer.weight": "per_layer_table",
    "per_layer_model_projection.weight": "per_layer_projection",
    "per_layer_projection_norm.weight": "per_layer_norm",
}
# Which norm sits where differs between the sandwich-norm (Gemma) and pre-norm layouts.
_POST_NORM_LAYOUT = {
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "ffn_norm",
    "post_feedforward_layernorm.weight": "post_ffn_norm",
}
_PRE_NORM_LAYOUT = {"post_attention_layernorm.weight": "ffn_norm"}
# Mixture-of-experts blocks: Mixtral's names and the Qwen MoE ones
_EXPERT_BLOCK_TENSORS = {
    "block_sparse_moe.gate.weight": "router",
    "mlp.gate.weight": "router",
    "mlp.shared_expert.gate_proj.weight": "shared_gate",
    "mlp.shared_expert.up_proj.weight": "shared_up",
    "mlp.shared_expert.down_proj.weight": "shared_down",
    "mlp.shared_expert_gate.weight": "shared_expert_gate",
    # GPT-OSS: a router with a bias, the experts fused (unfused by `_unfuse_experts`), sinks
    "mlp.router.weight": "router",
    "mlp.router.bias": "router_bias",
    "mlp.experts.gate_up_proj": "fused_gate_up",  # [E, H, 2F], gate and up interleaved
    "mlp.experts.gate_up_proj_bias": "fused_gate_up_bias",  # [E, 2F] interleaved
    "mlp.experts.down_proj": "fused_down",  # [E, F, H]
    "mlp.experts.down_proj_bias": "experts_down_bias",  # [E, H]
    "self_attn.sinks": "attn_sinks",
    # Gemma 4: experts beside the dense MLP, with a router of its own shape and their own norms
    "router.proj.weight": "router",
    "router.scale": "router_scale",
    "router.per_expert_scale": "per_expert_scale",
    "experts.gate_up_proj": "experts_gate_up",  # [E, 2F, H], gate rows then up rows
    "experts.down_proj": "experts_down",  # [E, H, F]
    "pre_feedforward_layernorm_2.weight": "experts_norm",
    "post_feedforward_layernorm_1.weight": "post_mlp_norm",
    "post_feedforward_layernorm_2.weight": "post_experts_norm",
}
_EXPERT = re.compile(
    r"(?:block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)|mlp\.experts\.(\d+)\.(gate|up|down)_proj)"
    r"\.weight"
)
_EXPERT_MATRIX = {"w1": "gate", "w3": "up", "w2": "down"}  # Mixtral's; Qwen's say it
_NORMS = {
    "attn_norm", "q_norm", "k_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm",
    "experts_norm", "post_mlp_norm", "post_experts_norm", "per_layer_post_norm", "per_layer_norm",
}  # fmt: skip


def read_hf_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"cannot read {path}: {e}") from e
    if "text_config" in raw and raw.get("model_type") in ("gemma3", "gemma3n", "gemma4"):
        raw = {**raw["text_config"], "tie_word_embeddings": raw.get("tie_word_embeddings", True)}
    return raw


def hf_config(raw: dict[str, Any], name: str = "") -> ModelConfig:
    preset = preset_for_hf(str(raw.get("model_type", "")))
    model_type = preset.arch.name
    if preset.unsupported is not None and (reason := preset.unsupported(raw)) is not None:
        raise UnsupportedArchitecture(reason)
    if raw.get("mlp_bias"):
        raise UnsupportedArchitecture(f"{model_type} with mlp_bias=true is not supported")
    method = (raw.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "mxfp4"):
        raise UnsupportedArchitecture(
            f"checkpoints quantised with {method!r} are not supported (supported: float "
            "weights, and MXFP4 experts); larql quantises weights itself (`--weights`)"
        )
    activation = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
    if activation not in _ACTIVATIONS:
        raise UnsupportedArchitecture(f"activation {activation!r} is not supported")
    arch = Arch(
        **{
            **vars(preset.arch),
            "activation": _ACTIVATIONS[activation],
            "attn_softcap": raw.get("attn_logit_softcapping"),
            "keys_as_values": bool(raw.get("attention_k_eq_v", False)),
            "final_softcap": raw.get("final_logit_softcapping"),
        }
    )
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    num_layers = int(raw["num_hidden_layers"])
    scalar = raw.get("query_pre_attn_scalar")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    layers = _layer_specs(raw, preset, num_layers, head_dim)
    max_positions = int(raw.get("max_position_embeddings", 2048))
    attn_scale = float(scalar) ** -0.5 if scalar else head_dim**-0.5
    if preset.attention_scale is not None:
        attn_scale = preset.attention_scale
    return ModelConfig(
        arch=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        max_positions=rope_context([spec.rope for spec in layers], max_positions),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        attn_scale=float(raw.get("attention_multiplier") or attn_scale),
        layers=layers,
        tie_embeddings=bool(raw.get("tie_word_embeddings", preset.tied_embeddings)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        name=name,
        experts=_expert_routing(raw, preset),
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        extra=multiplier_folds(
            float(raw.get("residual_multiplier", 1.0)), float(raw.get("logits_scaling", 1.0)), arch
        ),
    )


def _expert_routing(raw: dict[str, Any], preset: ArchPreset) -> ExpertRouting | None:
    count = raw.get("num_local_experts") or raw.get("num_experts")
    if not count:
        return None
    normalized = preset.experts_normalized
    if normalized is None:
        normalized = bool(raw.get("norm_topk_prob", False))
    swiglu = None
    if raw.get("swiglu_limit") is not None:
        swiglu = (float(raw.get("swiglu_alpha", 1.702)), float(raw["swiglu_limit"]))
    try:
        return ExpertRouting(
            int(count), int(raw.get("num_experts_per_tok") or raw["top_k_experts"]), normalized,
            clamped_swiglu=swiglu,
        )  # fmt: skip
    except (KeyError, ValueError) as e:
        raise ModelFormatError(f"bad mixture-of-experts settings in config.json: {e}") from e


def _layer_specs(
    raw: dict[str, Any], preset: ArchPreset, num_layers: int, head_dim: int
) -> tuple[LayerSpec, ...]:
    types = raw.get("layer_types") or [
        "sliding_attention" if sliding else "full_attention"
        for sliding in preset.sliding_layers(raw, num_layers)
    ]
    window = raw.get("sliding_window")
    shapes = _layer_shapes(raw, types)
    sources = _kv_sources(raw, types)
    wide = 2 * int(raw["intermediate_size"]) if raw.get("use_double_wide_mlp") else None
    specs = []
    for i, layer_type in enumerate(types):
        sliding = layer_type == "sliding_attention"
        width, kv_heads = shapes.get(i, (None, None))
        rope = _rope_for(raw, preset, layer_type, width or head_dim)
        source = sources.get(i)
        specs.append(
            LayerSpec(
                # a layer that says it slides but has no width attends fully (never a window of 0)
                int(window) if sliding and window else None, rope, width, kv_heads,
                kv_source=source, intermediate_size=wide if source is not None else None,
            )
        )  # fmt: skip
    return tuple(specs)


def _kv_sources(raw: dict[str, Any], types: list[str]) -> dict[int, int]:
    """Gemma 4's `num_kv_shared_layers`: each of the last N layers attends over the K/V of the
    last earlier layer of its own type (sliding or full) → {layer: source}."""
    shared = int(raw.get("num_kv_shared_layers") or 0)
    first = len(types) - shared
    sources = {}
    for i in range(max(first, 0), len(types)):
        same = [j for j in range(first) if types[j] == types[i]]
        if not same:
            raise ModelFormatError(
                f"layer {i} shares K/V but no layer before {first} is {types[i]}"
            )
        sources[i] = same[-1]
    return sources


def _layer_shapes(
    raw: dict[str, Any], types: list[str]
) -> dict[int, tuple[int | None, int | None]]:
    """Layers whose head width or K/V heads differ from the model's: transformers 5's
    `per_layer_config` ({"i": {"head_dim": …, "num_key_value_heads": …}}), or Gemma 4's
    `global_head_dim` / `num_global_key_value_heads` for its full-attention layers (the K/V
    head count only with keys as values, as transformers reads it)."""
    shapes: dict[int, tuple[int | None, int | None]] = {}
    per_layer = raw.get("per_layer_config") or {}
    for key, override in per_layer.items():
        kv = override.get("num_key_value_heads")
        shapes[int(key)] = (override.get("head_dim"), None if kv is None else int(kv))
    if not per_layer and (raw.get("global_head_dim") or raw.get("num_global_key_value_heads")):
        width = raw.get("global_head_dim")
        kv = raw.get("num_global_key_value_heads") if raw.get("attention_k_eq_v", True) else None
        for i, layer_type in enumerate(types):
            if layer_type == "full_attention":
                shapes[i] = (None if width is None else int(width), None if kv is None else int(kv))
    return shapes


def _rope_for(raw: dict[str, Any], preset: ArchPreset, layer_type: str, head_dim: int) -> RopeSpec:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    if not isinstance(params, dict):
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10_000.0))
        if preset.sliding_rope_base is not None and layer_type == "sliding_attention":
            base = raw.get("rope_local_base_freq", preset.sliding_rope_base)
            params = {"rope_type": "default", "rope_theta": base}
    return rope_spec(params, raw, head_dim)


def hf_state_dict(directory: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{directory} has no *.safetensors files")
    layout = _POST_NORM_LAYOUT if config.arch.post_norms else _PRE_NORM_LAYOUT
    state: dict[str, torch.Tensor] = {}
    packed: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 tensors: name → blocks, scales
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key.endswith(_MXFP4_PARTS):
                    name, part = key.rsplit("_", 1)
                    packed.setdefault(name, {})[part] = f.get_tensor(key)
                    continue
                canonical = _canonical_name(key, layout)
                if canonical is not None:
                    tensor = f.get_tensor(key).to(torch.float32)
                    if canonical.rsplit(".", 1)[-1] in _NORMS or canonical == "final_norm":
                        tensor = tensor + config.arch.norm_offset
                    state[canonical] = tensor
    state.update(_dequantized_mxfp4(packed, layout))
    for i in range(config.num_layers):
        if config.kv_source_of(i) is not None:  # its K/V are another layer's: drop any of its own
            for name in ("wk", "wv", "bk", "bv", "k_norm"):
                state.pop(f"layers.{i}.{name}", None)
        elif config.arch.keys_as_values:
            state.setdefault(f"layers.{i}.wv", state[f"layers.{i}.wk"])
    _stack_experts(state, config)
    _unfuse_experts(state)
    fold_multipliers(state, config)
    if config.tie_embeddings:
        state.pop("lm_head", None)
    elif "lm_head" not in state:
        raise ModelFormatError(f"{directory}: untied model without lm_head.weight")
    return state


_MXFP4_PARTS = ("_blocks", "_scales")


def _dequantized_mxfp4(
    packed: dict[str, dict[str, torch.Tensor]], layout: dict[str, str]
) -> dict[str, torch.Tensor]:
    """MXFP4 tensors (GPT-OSS's experts: X_blocks and X_scales, rows = output features) → the
    canonical tensors of X in the checkpoint's float layout [E, in, out]."""
    out = {}
    for name, parts in packed.items():
        canonical = _canonical_name(name, layout)
        if canonical is None:
            continue
        if set(parts) != {"blocks", "scales"}:
            raise ModelFormatError(f"MXFP4 tensor {name!r} lacks its _blocks or _scales")
        try:
            weights = dequantize_mxfp4(parts["blocks"], parts["scales"])  # [E, out, in]
        except ValueError as e:
            raise ModelFormatError(f"MXFP4 tensor {name!r}: {e}") from e
        out[canonical] = weights.transpose(-1, -2).contiguous()
    return out


def _stack_experts(state: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """layers.i.experts.j.w_{gate,up,down} → layers.i.experts_{gate,up,down} [E, …], in place."""
    for i in range(config.num_layers):
        prefix = f"layers.{i}.experts."
        held = (k[len(prefix) :] for k in state if k.startswith(prefix))
        indices = sorted({int(rest.split(".")[0]) for rest in held})
        if not indices:
            continue
        expected = config.experts.num_experts if config.experts is not None else 0
        if indices != list(range(expected)):
            raise ModelFormatError(
                f"layer {i} holds experts {indices[0]}..{indices[-1]} ({len(indices)}), "
                f"the config says {expected}"
            )
        for matrix in ("gate", "up", "down"):
            names = [f"{prefix}{j}.w_{matrix}" for j in indices]
            missing = [n for n in names if n not in state]
            if missing:
                raise ModelFormatError(f"weights are missing tensor {missing[0]!r}")
            state[f"layers.{i}.experts_{matrix}"] = torch.stack([state.pop(n) for n in names])


def _unfuse_experts(state: dict[str, torch.Tensor]) -> None:
    """GPT-OSS's fused experts → the canonical [E, F, H] gate / up and [E, H, F] down, in
    place: its gate_up [E, H, 2F] multiplies x from the right, gate and up columns alternating."""
    for key in [k for k in state if k.endswith((".fused_gate_up", ".fused_gate_up_bias"))]:
        fused = state.pop(key)
        prefix, bias = key.rsplit(".", 1)[0], "_bias" if key.endswith("_bias") else ""
        gate, up = fused[..., 0::2], fused[..., 1::2]  # [E, H, F] each (biases [E, F])
        if not bias:
            gate, up = gate.transpose(1, 2), up.transpose(1, 2)
        state[f"{prefix}.experts_gate{bias}"] = gate.contiguous()
        state[f"{prefix}.experts_up{bias}"] = up.contiguous()
    for key in [k for k in state if k.endswith(".fused_down")]:
        prefix = key.rsplit(".", 1)[0]
        state[f"{prefix}.experts_down"] = state.pop(key).transpose(1, 2).contiguous()


def _canonical_name(key: str, layout: dict[str, str]) -> str | None:
    if key == "lm_head.weight":
        return "lm_head"
    for prefix in _WEIGHT_PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix) :]
            break
    if key in _MODEL_TENSORS:
        return _MODEL_TENSORS[key]
    parts = key.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers":
        name = (
            _LAYER_TENSORS.get(parts[2]) or layout.get(parts[2])
            or _EXPERT_BLOCK_TENSORS.get(parts[2]) or _expert_matrix(parts[2])
        )  # fmt: skip
        if name is not None:
            return f"layers.{parts[1]}.{name}"
    return None


def _expert_matrix(key: str) -> str | None:
    """`block_sparse_moe.experts.3.w1.weight` / `mlp.experts.3.gate_proj.weight` →
    `experts.3.w_gate` (stacked across experts later)."""
    match = _EXPERT.fullmatch(key)
    if match is None:
        return None
    index, matrix = (match[1], match[2]) if match[1] is not None else (match[3], match[4])
    return f"experts.{index}.w_{_EXPERT_MATRIX.get(matrix, matrix)}"
