"""Tiny random HF models of every supported architecture, built with transformers' own config
classes and saved as HF directories (config.json + model.safetensors + tokenizer.json) for
larql to load; the in-memory transformers model is the oracle."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 96
WINDOW = 6  # sliding window of the tiny sliding-layer models; prompts are longer than this

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama",
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10_000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "mistral": dict(model_type="mistral", sliding_window=WINDOW, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True),
    "gemma2": dict(
        model_type="gemma2",
        sliding_window=WINDOW,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=0.5,
        query_pre_attn_scalar=16,
        hidden_activation="gelu_pytorch_tanh",
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        num_hidden_layers=6,
        layer_types=["sliding_attention"] * 2
        + ["full_attention"]
        + ["sliding_attention"] * 2
        + ["full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
        },
    ),
    # mixture-of-experts: 4 experts, 2 per token (Qwen2-MoE: a shared expert, a dense layer)
    "mixtral": dict(
        model_type="mixtral",
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=40,
        shared_expert_intermediate_size=64,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=40,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    # attention sinks, alternating sliding layers, yarn, experts with biases and a clamped SwiGLU
    "gpt_oss": dict(
        model_type="gpt_oss",
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        tie_word_embeddings=False,
        swiglu_limit=0.5,  # low enough that the tiny model's gates and ups are clamped
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150_000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_max_position_embeddings=64,
            truncate=False,
        ),
    ),
    # Gemma 4 text's dense core: q/k/v norms, scores scaled by 1, a scalar per layer, global
    # layers with proportional RoPE over a quarter of the pairs
    "gemma4": dict(
        model_type="gemma4_text",
        sliding_window=WINDOW,
        num_hidden_layers=6,
        head_dim=16,
        global_head_dim=16,
        hidden_size_per_layer_input=0,
        hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention"] * 2
        + ["full_attention"]
        + ["sliding_attention"] * 2
        + ["full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {
                "rope_type": "proportional",
                "rope_theta": 1_000_000.0,
                "partial_rotary_factor": 0.25,
            },
        },
    ),
    # the same with global layers of their own shape (32 wide, one K/V head) taking their keys as
    # values (no v_proj there), as the released checkpoints do
    "gemma4_global": dict(
        model_type="gemma4_text",
        attention_k_eq_v=True,
        global_head_dim=32,
        num_global_key_value_heads=1,
    ),
    # the 26B-A4B shape: 4 experts (2 per token) beside every layer's dense MLP
    "gemma4_moe": dict(
        model_type="gemma4_text",
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=24,
    ),
    # the E2B shape's per-layer inputs: a 4-wide input per layer from the token and its embedding
    "gemma4_ple": dict(
        model_type="gemma4_text",
        hidden_size_per_layer_input=4,
        vocab_size_per_layer_input=VOCAB,
    ),
    # the E2B shape: per-layer inputs, the last 2 of 6 layers attending over the K/V of the last
    # earlier layer of their kind (one sliding, one full) with double-wide MLPs
    "gemma4_shared": dict(
        model_type="gemma4_text",
        hidden_size_per_layer_input=4,
        vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
    ),
    "granite": dict(
        model_type="granite",
        embedding_multiplier=6.0,
        residual_multiplier=0.5,
        attention_multiplier=0.05,
        logits_scaling=4.0,
        tie_word_embeddings=True,
    ),
}


@dataclass
class TinyModel:
    arch: str
    directory: Path
    hf_model: Any  # transformers PreTrainedModel

    @torch.no_grad()
    def hf_logits(self, ids: list[int]) -> torch.Tensor:
        """[S, V] logits of the whole sequence from transformers."""
        return self.hf_model(torch.tensor([ids])).logits[0].float()


def build_tiny_model(arch: str, directory: Path, seed: int = 0, **overrides: Any) -> TinyModel:
    """`overrides` replace config entries of the architecture's tiny config (e.g. its RoPE)."""
    spec = {**ARCH_CONFIGS[arch], **overrides}
    if arch.startswith("gemma4_"):
        spec = {**ARCH_CONFIGS["gemma4"], **spec}
    model = random_hf_model(spec.pop("model_type"), seed, **spec)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return TinyModel(arch, directory, model)


def random_hf_model(model_type: str, seed: int = 0, **config: Any) -> Any:
    """A float32 eager transformers model of `model_type`, the tiny shape unless `config` says
    otherwise, with random norms and biases too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(model_type, **{**_COMMON, **config})
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random norms, so a wrong norm offset cannot hide
                offset = 0.0 if model_type in ("gemma2", "gemma3_text") else 1.0  # 1 + w there
                p.copy_(torch.randn_like(p) * 0.3 + offset)
            elif name.endswith((".bias", "_bias", ".sinks")):  # GPT-OSS: expert biases, sinks
                p.copy_(torch.randn_like(p) * (1.0 if name.endswith("sinks") else 0.1))
            elif name.endswith(("router.scale", "per_expert_scale")):  # Gemma 4: not all 1
                p.copy_(torch.rand_like(p) + 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4: not 1, so a missing scalar shows
                buffer.copy_(torch.rand_like(buffer) + 0.5)
    return model


def save_tokenizer(directory: Path) -> None:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))


def rewrite_config(directory: Path, **changes: Any) -> None:
    """Edit config.json in place (None removes a key), e.g. to write the transformers-4 form."""
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


def random_ids(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()
