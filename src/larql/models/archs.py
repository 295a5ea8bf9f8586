"""The architectures larql runs, one preset each: how its layers compute (`Arch`), which layers
slide when a config does not list them, and what its files call it. The GGUF and the HF loaders
both read this table; an architecture that is not in it is a clear error, never a default
branch. Adding an architecture is adding a row here (and a tiny test model); the forward pass
never branches on a name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from larql.models.config import Arch
from larql.models.errors import UnsupportedArchitecture
from larql.models.fields import Fields

# (the model's settings, its depth) → whether each layer slides, for configs that do not say
SlidingLayers = Callable[[Mapping[str, Any], int], list[bool]]


def no_sliding_layers(settings: Mapping[str, Any], num_layers: int) -> list[bool]:
    return [False] * num_layers


def every_layer_if_windowed(settings: Mapping[str, Any], num_layers: int) -> list[bool]:
    """Mistral: a `sliding_window` applies to every layer."""
    return [bool(settings.get("sliding_window"))] * num_layers


def even_layers(settings: Mapping[str, Any], num_layers: int) -> list[bool]:
    """Gemma 2: sliding and global layers alternate, starting with a sliding one."""
    return [i % 2 == 0 for i in range(num_layers)]


def all_but_every_nth(settings: Mapping[str, Any], num_layers: int) -> list[bool]:
    """Gemma 3: every `sliding_window_pattern`-th layer (6) is global, the others slide."""
    every = Fields(settings).integer("sliding_window_pattern", 6, low=1)
    return [(i + 1) % every != 0 for i in range(num_layers)]


def from_max_window_layers(settings: Mapping[str, Any], num_layers: int) -> list[bool]:
    """Qwen 2/3: with `use_sliding_window`, layers from `max_window_layers` on slide."""
    if not settings.get("use_sliding_window"):
        return [False] * num_layers
    first = Fields(settings).integer("max_window_layers", num_layers)
    return [i >= first for i in range(num_layers)]


@dataclass(frozen=True)
class ArchPreset:
    arch: Arch  # how every layer computes (an HF config's activation and soft-caps override)
    sliding_layers: SlidingLayers = no_sliding_layers
    hf_model_types: tuple[str, ...] = ()  # `model_type` values of HF configs
    gguf_name: str | None = None  # `general.architecture` of GGUF files (None: HF only)
    # RoPE base of the sliding layers where the files do not record it (Gemma 3's GGUF)
    sliding_rope_base: float | None = None
    # llama.cpp stores llama's Q/K rows interleaved for its RoPE; the loader restores split halves
    gguf_interleaved_qk: bool = False
    tied_embeddings: bool = False  # whether the LM head is the embedding when a config is silent
    # mixture-of-experts layers: whether the top-k routing weights are renormalised to sum to 1
    # (None: as the HF config's `norm_topk_prob` says; a GGUF's `expert_weights_norm`, else
    # `gguf_experts_normalized`)
    experts_normalized: bool | None = None
    gguf_experts_normalized: bool = True
    # GGUF tensor kinds this architecture names differently from the common layout (GPT-OSS:
    # llama.cpp's `post_attention_norm` is its pre-FFN norm)
    gguf_renamed: Mapping[str, str] | None = None
    # the clamped SwiGLU (alpha, limit) of its experts where a GGUF file does not record it
    gguf_clamped_swiglu: tuple[float, float] | None = None
    # the attention's score scale where it is not 1/√head_dim (nor the config's
    # `query_pre_attn_scalar`): Gemma 4 scales by 1, its q and k being RMS-normed
    attention_scale: float | None = None
    # what of a config this preset does not run yet: settings → the refusal's reason, or None
    unsupported: Callable[[Mapping[str, Any]], str | None] | None = None


# what every Gemma shares (its presets `replace` the rest)
_GEMMA = Arch(
    name="gemma", activation="gelu_tanh", norm_offset=1.0, post_norms=True, scale_embeddings=True
)


def gemma4_unsupported(settings: Mapping[str, Any]) -> str | None:
    """The part of Gemma 4 text larql does not run yet: text attending both ways. Everything
    else runs: q/k/v norms, the layer scalar, proportional RoPE, keys as values, global layers
    with a head width and K/V heads of their own, per-layer inputs, the experts beside the
    dense MLP, K/V shared across layers."""
    if settings.get("use_bidirectional_attention") == "all":  # "vision": text stays causal
        return "Gemma 4 with bidirectional attention over text is not supported yet"
    return None


ARCHITECTURES: dict[str, ArchPreset] = {
    # llama.cpp writes Mistral models as llama; a window in the file applies to every layer
    "llama": ArchPreset(
        Arch(name="llama"),
        every_layer_if_windowed,
        hf_model_types=("llama",),
        gguf_name="llama",
        gguf_interleaved_qk=True,
    ),
    "mistral": ArchPreset(
        Arch(name="mistral"), every_layer_if_windowed, hf_model_types=("mistral",)
    ),
    "qwen2": ArchPreset(
        Arch(name="qwen2"), from_max_window_layers, hf_model_types=("qwen2",), gguf_name="qwen2"
    ),
    "qwen3": ArchPreset(
        Arch(name="qwen3", qk_norm=True),
        from_max_window_layers,
        hf_model_types=("qwen3",),
        gguf_name="qwen3",
    ),
    "mixtral": ArchPreset(
        Arch(name="mixtral"),
        every_layer_if_windowed,
        hf_model_types=("mixtral",),
        experts_normalized=True,
    ),
    "qwen2_moe": ArchPreset(
        Arch(name="qwen2_moe"),
        from_max_window_layers,
        hf_model_types=("qwen2_moe",),
        gguf_name="qwen2moe",
        gguf_experts_normalized=False,
    ),
    "qwen3_moe": ArchPreset(
        Arch(name="qwen3_moe", qk_norm=True),
        from_max_window_layers,
        hf_model_types=("qwen3_moe",),
        gguf_name="qwen3moe",
    ),
    # learned attention sinks, alternating sliding layers (`layer_types`), experts routed by a
    # softmax over the top-k logits (= the renormalised top k), with biases, a clamped SwiGLU
    "gpt_oss": ArchPreset(
        Arch(name="gpt_oss", attention_sinks=True),
        even_layers,
        hf_model_types=("gpt_oss",),
        experts_normalized=True,
        gguf_name="gpt-oss",
        gguf_renamed={"post_attention_norm": "ffn_norm"},
        gguf_clamped_swiglu=(1.702, 7.0),
    ),
    # embedding, attention, residual and logit multipliers (the last two folded into weights)
    "granite": ArchPreset(
        Arch(name="granite"),
        hf_model_types=("granite",),
        gguf_name="granite",
        gguf_interleaved_qk=True,
    ),
    # fused QKV and gate/up matrices are split at load time; partial RoPE is the file's
    "phi3": ArchPreset(Arch(name="phi3"), every_layer_if_windowed, gguf_name="phi3"),
    "gemma2": ArchPreset(
        replace(_GEMMA, name="gemma2"),
        even_layers,
        hf_model_types=("gemma2",),
        tied_embeddings=True,
    ),
    "gemma3": ArchPreset(
        replace(_GEMMA, name="gemma3", qk_norm=True),
        all_but_every_nth,
        hf_model_types=("gemma3", "gemma3_text"),
        gguf_name="gemma3",
        sliding_rope_base=10_000.0,
        tied_embeddings=True,
    ),
    # Gemma 4 text's dense core: norms used as stored (no 1 + w), q/k/v RMS-normed (v without a
    # weight), scores scaled by 1, a learned scalar on each layer's output, global layers with
    # proportional RoPE
    "gemma4": ArchPreset(
        replace(_GEMMA, name="gemma4", qk_norm=True, v_norm=True, norm_offset=0.0),
        all_but_every_nth,
        hf_model_types=("gemma4_text",),
        tied_embeddings=True,
        attention_scale=1.0,
        experts_normalized=True,
        unsupported=gemma4_unsupported,
    ),
}

HF_MODEL_TYPES = {t: preset for preset in ARCHITECTURES.values() for t in preset.hf_model_types}
GGUF_NAMES = {p.gguf_name: p for p in ARCHITECTURES.values() if p.gguf_name is not None}


def preset_for_hf(model_type: str) -> ArchPreset:
    supported = [name for name, preset in ARCHITECTURES.items() if preset.hf_model_types]
    return _lookup(HF_MODEL_TYPES, model_type, "model_type", ", ".join(supported))


def preset_for_gguf(name: str) -> ArchPreset:
    supported = ", ".join(sorted(GGUF_NAMES))
    return _lookup(
        GGUF_NAMES,
        name,
        "GGUF architecture",
        f"{supported} (other architectures load from an HF directory)",
    )


def _lookup(table: Mapping[str, ArchPreset], key: str, what: str, supported: str) -> ArchPreset:
    preset = table.get(key)
    if preset is None:
        raise UnsupportedArchitecture(f"{what} {key!r} is not supported; supported: {supported}")
    return preset
