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
from safetensors import SafetensorError, safe_open

from larql.models.archs import ArchPreset, preset_for_hf
from larql.models.config import Arch, ExpertRouting, LayerSpec, ModelConfig, RopeSpec
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
from larql.models.hf_rope import rope_context, rope_spec
from larql.models.multipliers import fold_multipliers, multiplier_folds
from larql.models.mxfp4 import dequantize_mxfp4
from larql.models.shard import shard_state, share_index
from larql.models.weights import expected_shape

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
    "attn_norm",
    "q_norm",
    "k_norm",
    "post_attn_norm",
    "ffn_norm",
    "post_ffn_norm",
    "experts_norm",
    "post_mlp_norm",
    "post_experts_norm",
    "per_layer_post_norm",
    "per_layer_norm",
}


def read_hf_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ModelFormatError(f"cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{path} is {show(raw)}, not a JSON object")
    if "text_config" in raw and raw.get("model_type") in ("gemma3", "gemma3n", "gemma4"):
        text = raw["text_config"]
        if not isinstance(text, dict):
            raise ModelFormatError(f"{path}: text_config is {show(text)}, not a JSON object")
        raw = {**text, "tie_word_embeddings": raw.get("tie_word_embeddings", True)}
    return raw


def hf_config(raw: dict[str, Any], name: str = "") -> ModelConfig:
    """The model's config from an HF `config.json` (its text part), every setting typed and
    bounded before anything is sized from it."""
    c = Fields(raw)
    preset = preset_for_hf(c.text("model_type", ""))
    model_type = preset.arch.name
    if preset.unsupported is not None and (reason := preset.unsupported(raw)) is not None:
        raise UnsupportedArchitecture(reason)
    if raw.get("mlp_bias"):
        raise UnsupportedArchitecture(f"{model_type} with mlp_bias=true is not supported")
    quantization = c.mapping("quantization_config")
    method = quantization.raw("quant_method") if quantization is not None else None
    if method not in (None, "mxfp4"):
        raise UnsupportedArchitecture(
            f"checkpoints quantised with {show(method)} are not supported (supported: float "
            "weights, and MXFP4 experts); larql quantises weights itself (`--weights`)"
        )
    activation = c.text("hidden_activation", None) or c.text("hidden_act", "silu")
    if activation not in _ACTIVATIONS:
        raise UnsupportedArchitecture(f"activation {show(activation)} is not supported")
    arch = Arch(
        **{
            **vars(preset.arch),
            "activation": _ACTIVATIONS[activation],
            "attn_softcap": c.optional_number("attn_logit_softcapping", positive=True),
            "keys_as_values": c.flag("attention_k_eq_v", False),
            "final_softcap": c.optional_number("final_logit_softcapping", positive=True),
        }
    )
    hidden = c.integer("hidden_size", low=1, high=MAX_WIDTH)
    heads = c.integer("num_attention_heads", low=1, high=MAX_HEADS)
    head_dim = c.integer("head_dim", 0, high=MAX_HEAD_DIM) or hidden // heads
    if head_dim < 1:
        raise ModelFormatError(
            f"num_attention_heads {heads} is more than hidden_size {hidden}, and no head_dim"
        )
    num_layers = c.integer("num_hidden_layers", low=1, high=MAX_LAYERS)
    vocab = c.integer("vocab_size", low=1, high=MAX_VOCAB)
    intermediate = c.integer("intermediate_size", low=1, high=MAX_WIDTH)
    scalar = c.optional_number("query_pre_attn_scalar", positive=True)
    layers = _layer_specs(c, preset, num_layers, head_dim, heads, intermediate)
    max_positions = c.integer("max_position_embeddings", 2048, low=1, high=MAX_CONTEXT)
    attn_scale = scalar**-0.5 if scalar else head_dim**-0.5
    if preset.attention_scale is not None:
        attn_scale = preset.attention_scale
    try:
        return ModelConfig(
            arch=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=c.integer("num_key_value_heads", 0, high=heads) or heads,
            head_dim=head_dim,
            max_positions=rope_context([spec.rope for spec in layers], max_positions),
            norm_eps=c.number("rms_norm_eps", 1e-6),
            attn_scale=c.optional_number("attention_multiplier") or attn_scale,
            layers=layers,
            tie_embeddings=c.flag("tie_word_embeddings", preset.tied_embeddings),
            bos_token_id=c.optional_integer("bos_token_id", high=vocab - 1),
            eos_token_ids=c.integers("eos_token_id", high=vocab - 1),
            name=name,
            experts=_expert_routing(c, preset),
            embedding_multiplier=c.number("embedding_multiplier", 1.0),
            extra=multiplier_folds(
                c.number("residual_multiplier", 1.0),
                c.number("logits_scaling", 1.0, positive=True),
                arch,
            ),
        )
    except ValueError as e:
        raise ModelFormatError(f"inconsistent attention settings: {e}") from None


def _expert_routing(c: Fields, preset: ArchPreset) -> ExpertRouting | None:
    count = c.optional_integer("num_local_experts", high=MAX_EXPERTS) or c.optional_integer(
        "num_experts", high=MAX_EXPERTS
    )
    if not count:
        return None
    normalized = preset.experts_normalized
    if normalized is None:
        normalized = c.flag("norm_topk_prob", False)
    swiglu = None
    limit = c.optional_number("swiglu_limit")
    if limit is not None:
        swiglu = (c.number("swiglu_alpha", 1.702), limit)
    top_k = c.optional_integer("num_experts_per_tok") or c.integer("top_k_experts")
    # Mixtral's and GPT-OSS's experts are `intermediate_size` wide (they have no dense MLP)
    width = c.optional_integer("moe_intermediate_size", low=1, high=MAX_WIDTH)
    width = width or c.integer("intermediate_size", low=1, high=MAX_WIDTH)
    shared = c.optional_integer("shared_expert_intermediate_size", high=MAX_WIDTH)
    try:
        return ExpertRouting(count, top_k, normalized, swiglu, width, shared)
    except ValueError as e:
        raise ModelFormatError(f"bad mixture-of-experts settings: {e}") from None


_LAYER_TYPES = ("full_attention", "sliding_attention")


def _layer_specs(
    c: Fields, preset: ArchPreset, num_layers: int, head_dim: int, heads: int, intermediate: int
) -> tuple[LayerSpec, ...]:
    types = _layer_types(c, preset, num_layers)
    window = c.optional_integer("sliding_window", high=MAX_CONTEXT)
    shapes = _layer_shapes(c, types, heads)
    sources = _kv_sources(c, types)
    wide = 2 * intermediate if c.flag("use_double_wide_mlp", False) else None
    specs = []
    for i, layer_type in enumerate(types):
        sliding = layer_type == "sliding_attention"
        width, kv_heads = shapes.get(i, (None, None))
        rope = _rope_for(c, preset, layer_type, width or head_dim)
        source = sources.get(i)
        specs.append(
            LayerSpec(
                # a layer that says it slides but has no width attends fully (never a window of 0)
                window if sliding and window else None,
                rope,
                width,
                kv_heads,
                kv_source=source,
                intermediate_size=wide if source is not None else None,
            )
        )
    return tuple(specs)


def _layer_types(c: Fields, preset: ArchPreset, num_layers: int) -> list[str]:
    """`layer_types` (one per layer), else the preset's rule for which layers slide."""
    types = c.raw("layer_types")
    if types is None:
        sliding = preset.sliding_layers(c.raw_mapping(), num_layers)
        return ["sliding_attention" if s else "full_attention" for s in sliding]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelFormatError(
            f"layer_types is {show(types)}; expected a list of num_hidden_layers = {num_layers}"
        )
    for i, layer_type in enumerate(types):
        if layer_type not in _LAYER_TYPES:
            raise UnsupportedArchitecture(
                f"layer_types[{i}] = {show(layer_type)} is not supported (supported: "
                f"{', '.join(_LAYER_TYPES)})"
            )
    return types


def _kv_sources(c: Fields, types: list[str]) -> dict[int, int]:
    """Gemma 4's `num_kv_shared_layers`: each of the last N layers attends over the K/V of the
    last earlier layer of its own type (sliding or full) → {layer: source}."""
    shared = c.integer("num_kv_shared_layers", 0, high=len(types))
    first = len(types) - shared
    sources = {}
    for i in range(first, len(types)):
        same = [j for j in range(first) if types[j] == types[i]]
        if not same:
            raise ModelFormatError(
                f"layer {i} shares K/V but no layer before {first} is {types[i]}"
            )
        sources[i] = same[-1]
    return sources


def _layer_shapes(
    c: Fields, types: list[str], heads: int
) -> dict[int, tuple[int | None, int | None]]:
    """Layers whose head width or K/V heads differ from the model's: transformers 5's
    `per_layer_config` ({"i": {"head_dim": …, "num_key_value_heads": …}}), or Gemma 4's
    `global_head_dim` / `num_global_key_value_heads` for its full-attention layers (the K/V
    head count only with keys as values, as transformers reads it)."""
    shapes: dict[int, tuple[int | None, int | None]] = {}
    per_layer = c.mapping("per_layer_config")
    for key in per_layer.keys() if per_layer is not None else ():
        override = per_layer.mapping(key)  # type: ignore[union-attr]
        if not key.isdigit() or int(key) >= len(types) or override is None:
            raise ModelFormatError(
                f"per_layer_config.{show(key)} is not an override of one of the {len(types)} layers"
            )
        shapes[int(key)] = (
            override.optional_integer("head_dim", low=1, high=MAX_HEAD_DIM),
            override.optional_integer("num_key_value_heads", low=1, high=heads),
        )
    if per_layer is None and (c.has("global_head_dim") or c.has("num_global_key_value_heads")):
        width = c.optional_integer("global_head_dim", low=1, high=MAX_HEAD_DIM)
        kv = c.optional_integer("num_global_key_value_heads", low=1, high=heads)
        if not c.flag("attention_k_eq_v", True):
            kv = None
        for i, layer_type in enumerate(types):
            if layer_type == "full_attention":
                shapes[i] = (width, kv)
    return shapes


def _rope_for(c: Fields, preset: ArchPreset, layer_type: str, head_dim: int) -> RopeSpec:
    raw = c.raw_mapping()
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    if not isinstance(params, dict):
        scaling = c.mapping("rope_scaling")
        params = dict(scaling.raw_mapping()) if scaling is not None else {}
        params.setdefault("rope_theta", raw.get("rope_theta", 10_000.0))
        if preset.sliding_rope_base is not None and layer_type == "sliding_attention":
            base = raw.get("rope_local_base_freq", preset.sliding_rope_base)
            params = {"rope_type": "default", "rope_theta": base}
    return rope_spec(params, raw, head_dim)


def hf_state_dict(
    directory: Path,
    config: ModelConfig,
    meta: bool = False,
    share: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """The canonical state of the directory's safetensors files, each tensor converted to
    `dtype` as it is read (through float32, where the loader's own fixes are made: a norm's
    offset; a model whose multipliers are folded into its weights, or an MXFP4 tensor, is held
    in float32 until the end). `meta`: every tensor on torch's meta device instead, its shape
    (and the checks on it) from the files' headers, no weight read (`larql.models.structure`).

    share: (rank, world) of a tensor-parallel group → that rank's share of the state, as
    `larql.models.shard.shard_state` cuts the whole one; every tensor the cut takes one slice of
    (`share_index`) is read as that slice alone, so a rank never holds another rank's rows."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{directory} has no *.safetensors files")
    layout = _POST_NORM_LAYOUT if config.arch.post_norms else _PRE_NORM_LAYOUT
    # the dtype a tensor takes as it is read; None: float32 until the folds are made
    early = None if _folds(config) else dtype
    state: dict[str, torch.Tensor] = {}
    sliced: set[str] = set()  # the canonical names read as the rank's slice
    packed: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 tensors: name → blocks, scales
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if key.endswith(_MXFP4_PARTS):
                        name, part = key.rsplit("_", 1)
                        packed.setdefault(name, {})[part] = (
                            _meta_tensor(f, key) if meta else f.get_tensor(key)
                        )
                        continue
                    canonical = _canonical_name(key, layout)
                    if canonical is None:
                        continue
                    index = None
                    if share is not None:
                        shape = tuple(f.get_slice(key).get_shape())
                        index = share_index(config, canonical, shape, *share)
                    tensor = _read_tensor(f, key, canonical, config, meta, index)
                    if canonical.rsplit(".", 1)[-1] in _NORMS or canonical == "final_norm":
                        tensor = tensor.to(torch.float32) + config.arch.norm_offset
                    state[canonical] = _convert(tensor, early)
                    if index is not None:
                        sliced.add(canonical)
        except (OSError, SafetensorError) as e:
            raise ModelFormatError(f"{file.name} is not a readable safetensors file: {e}") from None
    state.update(_dequantized_mxfp4(packed, layout))
    for i in range(config.num_layers):
        if config.kv_source_of(i) is not None:  # its K/V are another layer's: drop any of its own
            for name in _OWN_KV:
                state.pop(f"layers.{i}.{name}", None)
        elif config.arch.keys_as_values and f"layers.{i}.wk" in state:
            state.setdefault(f"layers.{i}.wv", state[f"layers.{i}.wk"])
            if f"layers.{i}.wk" in sliced:  # (a file's own wv is read as a slice alike)
                sliced.add(f"layers.{i}.wv")
    sliced |= {_stacked_name(name) for name in sliced if ".experts." in name}
    _stack_experts(state, config)
    _unfuse_experts(state)
    fold_multipliers(state, config)
    if config.tie_embeddings:
        state.pop("lm_head", None)
    elif "lm_head" not in state:
        raise ModelFormatError(f"{directory}: untied model without lm_head.weight")
    if share is not None:  # what was read whole and is cut other than as one slice
        rest = {name: t for name, t in state.items() if name not in sliced}
        state.update(shard_state(config, rest, *share))
    return {name: _convert(t, dtype) for name, t in state.items()}


_MXFP4_PARTS = ("_blocks", "_scales")
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_OWN_KV = ("wk", "wv", "bk", "bv", "k_norm")  # what a layer sharing another's K/V drops


def _folds(config: ModelConfig) -> bool:
    """Whether `fold_multipliers` changes any weight of `config`'s (then in float32)."""
    return bool({"residual_multiplier", "logits_scaling"} & set(config.extra))


def _convert(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` in `dtype` (None: float32) as the float32 state converted to it: a float64
    file's values are rounded to float32 first, as that state's were; the other float dtypes
    convert to any dtype through float32 exactly."""
    if tensor.device.type == "meta":
        return tensor
    if dtype is None or tensor.dtype == torch.float64:
        tensor = tensor.to(torch.float32)
    return tensor if dtype is None else tensor.to(dtype)


def _stacked_name(name: str) -> str:
    """`layers.i.experts.j.w_gate` → `layers.i.experts_gate` (as `_stack_experts` names it)."""
    layer, _, rest = name.partition(".experts.")
    return f"{layer}.experts_{rest.rpartition('.w_')[2]}"


def _read_tensor(
    f: Any,
    key: str,
    canonical: str,
    config: ModelConfig,
    meta: bool = False,
    index: tuple[slice, ...] | None = None,
) -> torch.Tensor:
    """One tensor in its file's dtype, its dtype and shape checked from the file's header first
    (`meta`: a float32 meta tensor of that shape, nothing read); `index`: that slice of it
    alone is read."""
    part = f.get_slice(key)
    dtype, shape = part.get_dtype(), tuple(part.get_shape())
    if dtype not in _FLOAT_DTYPES:
        raise ModelFormatError(
            f"tensor {key} is stored as {dtype}; weights are floats ({', '.join(_FLOAT_DTYPES)})"
        )
    layer, _, kind = canonical.partition(".")[2].partition(".")
    dropped = kind in _OWN_KV and layer.isdigit() and _shares_kv(config, int(layer))
    want = None if dropped else expected_shape(config, canonical)
    if want is not None and shape != want:
        raise ModelFormatError(f"tensor {key} has shape {shape}; config.json implies {want}")
    if meta:
        whole = torch.empty(shape, dtype=torch.float32, device="meta")
        return whole if index is None else whole[index]
    return f.get_tensor(key) if index is None else part[index]


def _meta_tensor(f: Any, key: str) -> torch.Tensor:
    """A meta tensor of the shape and dtype the file's header gives `key` (uint8 stays uint8,
    what the MXFP4 checks look for; other dtypes become float32)."""
    part = f.get_slice(key)
    dtype = torch.uint8 if part.get_dtype() == "U8" else torch.float32
    return torch.empty(tuple(part.get_shape()), dtype=dtype, device="meta")


def _shares_kv(config: ModelConfig, layer: int) -> bool:
    return layer < config.num_layers and config.kv_source_of(layer) is not None


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
        blocks, scales = parts["blocks"], parts["scales"]
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 3:
            raise ModelFormatError(
                f"MXFP4 tensor {name!r}: blocks {blocks.dtype} {tuple(blocks.shape)} and scales "
                f"{scales.dtype}; expected uint8 blocks [..., R, G, 16] and uint8 scales"
            )
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
            if len({state[n].shape for n in names}) > 1:
                raise ModelFormatError(f"layer {i}'s experts' {matrix} matrices differ in shape")
            state[f"layers.{i}.experts_{matrix}"] = torch.stack([state.pop(n) for n in names])


def _unfuse_experts(state: dict[str, torch.Tensor]) -> None:
    """GPT-OSS's fused experts → the canonical [E, F, H] gate / up and [E, H, F] down, in
    place: its gate_up [E, H, 2F] multiplies x from the right, gate and up columns alternating."""
    for key in [k for k in state if k.endswith((".fused_gate_up", ".fused_gate_up_bias"))]:
        fused = state.pop(key)
        prefix, bias = key.rsplit(".", 1)[0], "_bias" if key.endswith("_bias") else ""
        if fused.dim() != (2 if bias else 3) or fused.shape[-1] % 2:
            raise ModelFormatError(
                f"{key} has shape {tuple(fused.shape)}; expected [E, H, 2F] (a bias: [E, 2F])"
            )
        gate, up = fused[..., 0::2], fused[..., 1::2]  # [E, H, F] each (biases [E, F])
        if not bias:
            gate, up = gate.transpose(1, 2), up.transpose(1, 2)
        state[f"{prefix}.experts_gate{bias}"] = gate.contiguous()
        state[f"{prefix}.experts_up{bias}"] = up.contiguous()
    for key in [k for k in state if k.endswith(".fused_down")]:
        prefix = key.rsplit(".", 1)[0]
        if state[key].dim() != 3:
            raise ModelFormatError(f"{key} has shape {tuple(state[key].shape)}; expected [E, F, H]")
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
            _LAYER_TENSORS.get(parts[2])
            or layout.get(parts[2])
            or _EXPERT_BLOCK_TENSORS.get(parts[2])
            or _expert_matrix(parts[2])
        )
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
