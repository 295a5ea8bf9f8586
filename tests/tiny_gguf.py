"""Tiny random HF models written to GGUF with the `gguf` package's writer, the way llama.cpp's
converter lays them out (tensor names, metadata keys, llama's permuted Q/K rows, Phi-3's fused
matrices), plus a tiny byte-level BPE tokenizer trained here with `tokenizers`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# HF parameter name (after `model.layers.N.`) → llama.cpp tensor name (after `blk.N.`)
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate rows, then up rows
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

# Qwen 2's split rule (its published tokenizer config), for the reference tokenizer
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PHI3_SPECIAL = ["<|user|>", "<|assistant|>", "<|end|>"]
PHI3_CHAT = (
    "{% for message in messages %}{{'<|' + message['role'] + '|>' + '\n' + message['content'] + "
    "'<|end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}"
    "{% endif %}"
)
_CORPUS = [
    "The quick brown fox (jumps) over the lazy dog; $prices rise 12345 times.",
    "I'm sure they'LL say it's fine, WE'VE done THIS before: \"quoted\" [bracketed] {braced}.",
    "def square(x):\n    return x ** 2  # 2024-01-31\n\n\tindented\r\nwindows line",
    "Café, naïve, Zürich, 日本語のテキスト and 中文文本, emoji 🙂🙂 and #hashtags @mentions.",
]


def qwen2_reference_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE with Qwen 2's split and NFC, trained on a small corpus; the oracle for
    larql's rebuild of it from GGUF metadata."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return tok


@dataclass
class GgufTokenizer:
    """What a GGUF's `tokenizer.*` keys hold."""

    model: str
    tokens: list[str]
    types: list[int]
    merges: list[str] = field(default_factory=list)
    pre: str | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    chat_template: str | None = None
    add_bos: bool = False


def byte_level_gguf_tokenizer(tok: Tokenizer, vocab_size: int, pre: str) -> GgufTokenizer:
    """The GGUF form of a trained byte-level BPE, padded with unused control tokens."""
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    special = {t["content"] for t in spec["added_tokens"]}
    types = [3 if t in special else 1 for t in tokens]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [3] * (vocab_size - len(types))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    eos = vocab["<|endoftext|>"]
    return GgufTokenizer("gpt2", tokens, types, merges, pre, None, eos, CHATML)


def word_gguf_tokenizer(vocab_size: int) -> GgufTokenizer:
    """A SentencePiece-style ("llama") vocabulary: <unk>, <s>, </s>, the pieces of the words
    "▁w0".."▁w9" (each merge's parts before it), the words, then unused fillers."""
    digits = [str(d) for d in range(10)]
    tokens = ["<unk>", "<s>", "</s>", *PHI3_SPECIAL, "<0x0A>"]
    types = [2, 3, 3, *[3] * len(PHI3_SPECIAL), 6]  # unknown, control, byte
    words = ["▁", "w", *digits, "▁w", *[f"▁w{d}" for d in digits]]
    tokens += words + [f"▁filler{i}" for i in range(len(tokens) + len(words), vocab_size)]
    types += [1] * (vocab_size - len(types))
    return GgufTokenizer(
        "llama", tokens, types, bos_id=1, eos_id=2, chat_template=PHI3_CHAT, add_bos=True
    )


def write_gguf(
    hf_model: Any,
    arch: str,
    path: Path,
    tokenizer: GgufTokenizer,
    *,
    permute_qk: bool = False,
    sliding_window: int | None = None,
    rotary_dim: int | None = None,
    q8_0: bool = False,
    q4_k: bool = False,
    mxfp4: bool = False,
) -> Path:
    """`hf_model`'s weights and shape as a GGUF of architecture `arch` (a mixture of experts'
    stacked experts included): float32, or with
    `q8_0` every matrix whose width is a multiple of 32 in Q8_0 blocks, with `q4_k` every one
    whose width is a multiple of 256 in Q4_K super-blocks (`quantize_q4_k`), with `mxfp4` the
    experts' matrices in MXFP4 (as llama.cpp ships GPT-OSS)."""
    import gguf

    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = c.num_key_value_heads or c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(rotary_dim or head_dim)
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if getattr(c, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    for add, multiplier in (
        (w.add_embedding_scale, "embedding_multiplier"),  # Granite's, as llama.cpp names them
        (w.add_residual_scale, "residual_multiplier"),
        (w.add_attention_scale, "attention_multiplier"),
        (w.add_logit_scale, "logits_scaling"),
    ):
        if getattr(c, multiplier, None) is not None:
            add(float(getattr(c, multiplier)))
    _add_tokenizer(w, tokenizer)
    tied = bool(getattr(c, "tie_word_embeddings", False))
    for name, tensor in hf_model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        for gguf_name, array in _gguf_tensors(name, tensor.detach().float().numpy(), arch):
            if mxfp4 and "_exps.weight" in gguf_name:
                mxfp4_type = gguf.GGMLQuantizationType.MXFP4
                raw = gguf.quants.quantize(np.ascontiguousarray(array), mxfp4_type)
                w.add_tensor(gguf_name, raw, raw_dtype=mxfp4_type)
                continue
            _add_tensor(w, gguf_name, array, c, kv_heads, permute_qk, q8_0, q4_k)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_tensors(hf_name: str, array: np.ndarray, arch: str) -> list[tuple[str, np.ndarray]]:
    """One HF tensor → the GGUF tensors llama.cpp's converter writes for it: a mixture of
    experts' stacked [E, 2F, H] gate|up rows as `ffn_gate_exps` and `ffn_up_exps`, its [E, H, F]
    down rows as `ffn_down_exps`, a shared expert's gate row as a vector."""
    if arch == "gpt-oss":
        return _gpt_oss_tensors(hf_name, array)
    _, layer, module, kind = _split_layer(hf_name)
    if module == "mlp.experts" and kind == "gate_up_proj":
        gate, up = np.split(array, 2, axis=1)
        return [
            (f"blk.{layer}.ffn_gate_exps.weight", gate),
            (f"blk.{layer}.ffn_up_exps.weight", up),
        ]
    if module == "mlp.experts" and kind == "down_proj":
        return [(f"blk.{layer}.ffn_down_exps.weight", array)]
    if module == "mlp.shared_expert_gate":
        return [(_gguf_name(hf_name), array.reshape(-1))]
    return [(_gguf_name(hf_name), array)]


def _gpt_oss_tensors(hf_name: str, array: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """GPT-OSS as llama.cpp writes it: the fused [E, H, 2F] experts (gate and up columns
    alternating) split into [E, F, H] gate and up, [E, F, H] down as [E, H, F], their biases
    beside them; the router as `ffn_gate_inp`, the sinks as `attn_sinks`, and the pre-FFN norm
    named `post_attention_norm`."""
    if hf_name in _TOP_NAMES:
        return [(_TOP_NAMES[hf_name], array)]
    _, layer, module, kind = _split_layer(hf_name)
    blk = f"blk.{layer}"
    if module == "mlp.experts":
        if kind == "gate_up_proj":
            return [
                (f"{blk}.ffn_gate_exps.weight", array[..., 0::2].transpose(0, 2, 1)),
                (f"{blk}.ffn_up_exps.weight", array[..., 1::2].transpose(0, 2, 1)),
            ]
        if kind == "gate_up_proj_bias":
            return [
                (f"{blk}.ffn_gate_exps.bias", array[:, 0::2]),
                (f"{blk}.ffn_up_exps.bias", array[:, 1::2]),
            ]
        if kind == "down_proj":
            return [(f"{blk}.ffn_down_exps.weight", array.transpose(0, 2, 1))]
        return [(f"{blk}.ffn_down_exps.bias", array)]  # down_proj_bias
    if module == "mlp.router":
        return [(f"{blk}.ffn_gate_inp.{kind}", array)]
    if module == "self_attn" and kind == "sinks":
        return [(f"{blk}.attn_sinks.weight", array)]
    if module == "post_attention_layernorm":
        return [(f"{blk}.post_attention_norm.{kind}", array)]
    return [(_gguf_name(hf_name), array)]


def _add_tensor(
    w: Any,
    gguf_name: str,
    array: np.ndarray,
    c: Any,
    kv_heads: int,
    permute_qk: bool,
    q8_0: bool,
    q4_k: bool,
) -> None:
    import gguf

    if permute_qk and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
        n_head = c.num_attention_heads if "attn_q." in gguf_name else kv_heads
        array = _permute_rows(array, n_head)
    array = np.ascontiguousarray(array, dtype=np.float32)
    if q4_k and array.ndim == 2 and array.shape[1] % 256 == 0:
        raw = quantize_q4_k(array)
        w.add_tensor(gguf_name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    elif q8_0 and array.ndim == 2 and array.shape[1] % 32 == 0:
        raw = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(gguf_name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        w.add_tensor(gguf_name, array)


def quantize_q4_k(array: np.ndarray) -> np.ndarray:
    """float32 [out, in] (in a multiple of 256) → GGUF Q4_K bytes uint8 [out, in/256 · 144]: a
    plain rounding to the format (the `gguf` package writes no Q4_K); the file's weights are
    then whatever these bytes hold. Per sub-block j of 32: weight ≈ d·s_j·q − dmin·m_j."""
    out, width = array.shape
    sub = array.reshape(out, width // 256, 8, 32).astype(np.float64)  # [O, S, 8, 32]
    low = np.minimum(sub.min(axis=-1), 0.0)  # [O, S, 8] offsets ≤ 0
    step = np.maximum(sub.max(axis=-1) - low, 1e-8) / 15  # [O, S, 8]
    d = np.maximum(step.max(axis=-1) / 63, 1e-4).astype(np.float16)  # [O, S], f16-normal
    dmin = np.maximum(-low.min(axis=-1) / 63, 1e-4).astype(np.float16)
    d32, dmin32 = d.astype(np.float64)[..., None], dmin.astype(np.float64)[..., None]
    scales = np.clip(np.round(step / d32), 1, 63).astype(np.uint8)
    minimums = np.clip(np.round(-low / dmin32), 0, 63).astype(np.uint8)
    scale = (d32 * scales)[..., None]  # [O, S, 8, 1]
    offset = (dmin32 * minimums)[..., None]
    codes = np.clip(np.round((sub + offset) / scale), 0, 15).astype(np.uint8)  # [O, S, 8, 32]
    pairs = codes.reshape(out, width // 256, 4, 2, 32)  # 64 weights: low, then high nibbles
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(out, width // 256, 128)
    packed = np.empty((out, width // 256, 12), dtype=np.uint8)
    packed[..., 0:4] = (scales[..., :4] & 0x3F) | ((scales[..., 4:] >> 4) << 6)
    packed[..., 4:8] = (minimums[..., :4] & 0x3F) | ((minimums[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (scales[..., 4:] & 0x0F) | ((minimums[..., 4:] & 0x0F) << 4)
    halves = np.stack((d, dmin), axis=-1).view(np.uint8).reshape(out, width // 256, 4)
    return np.concatenate((halves, packed, qs), axis=-1).reshape(out, -1)


def _add_tokenizer(w: Any, tok: GgufTokenizer) -> None:
    w.add_tokenizer_model(tok.model)
    if tok.pre is not None:
        w.add_tokenizer_pre(tok.pre)
    w.add_token_list(tok.tokens)
    w.add_token_types(tok.types)
    if tok.merges:
        w.add_token_merges(tok.merges)
    if tok.bos_id is not None:
        w.add_bos_token_id(tok.bos_id)
    if tok.eos_id is not None:
        w.add_eos_token_id(tok.eos_id)
    w.add_add_bos_token(tok.add_bos)
    if tok.chat_template is not None:
        w.add_chat_template(tok.chat_template)


def _gguf_name(hf_name: str) -> str:
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    _, layer, module, kind = _split_layer(hf_name)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def _split_layer(hf_name: str) -> tuple[str, str, str, str]:
    # model.layers.N.self_attn.q_proj.weight → ("model.", N, "self_attn.q_proj", "weight")
    head, _, tail = hf_name.partition("layers.")
    layer, _, rest = tail.partition(".")
    module, _, kind = rest.rpartition(".")
    return head, layer, module, kind


def _permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order for llama Q/K: each head's split halves interleaved pairwise."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def rewrite_gguf(source: Path, target: Path, changes: dict[str, Any]) -> Path:
    """A copy of the GGUF `source`, its tensors as float32, with metadata keys changed: each
    value of `changes` replaces its key's (written as `_metadata_value` says), None removes it."""
    import gguf

    from larql.models.gguf_file import GgufFile

    src = GgufFile(source)
    w = gguf.GGUFWriter(str(target), src.architecture)
    w.kv_data[0].clear()  # the writer's own `general.architecture`: the loop writes it
    for key, value in {**src.metadata, **changes}.items():
        if key != "general.alignment" and value is not None:
            _metadata_value(w, key, value)
    for name in src.tensors:
        w.add_tensor(name, src.dequantize(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return target


def _metadata_value(w: Any, key: str, value: Any) -> None:
    """One metadata pair: a str, bool, int (uint32, else int64 / uint64 past its range), float
    (float32), list of one of those, or numpy array (an array of its dtype)."""
    import gguf

    t = gguf.GGUFValueType
    if isinstance(value, np.ndarray):
        items = {
            np.dtype(np.uint8): t.UINT8,
            np.dtype(np.int8): t.INT8,
            np.dtype(np.uint16): t.UINT16,
            np.dtype(np.int16): t.INT16,
            np.dtype(np.uint32): t.UINT32,
            np.dtype(np.int32): t.INT32,
            np.dtype(np.float32): t.FLOAT32,
            np.dtype(np.bool_): t.BOOL,
            np.dtype(np.uint64): t.UINT64,
            np.dtype(np.int64): t.INT64,
            np.dtype(np.float64): t.FLOAT64,
        }
        w.add_key_value(key, value.tolist(), t.ARRAY, sub_type=items[value.dtype])
    elif isinstance(value, list):
        sub = _scalar_type(value[0]) if value else t.UINT32
        w.add_key_value(key, value, t.ARRAY, sub_type=sub)
    else:
        w.add_key_value(key, value, _scalar_type(value))


def _scalar_type(value: Any) -> Any:
    import gguf

    t = gguf.GGUFValueType
    if isinstance(value, bool):
        return t.BOOL
    if isinstance(value, int):
        return t.UINT32 if 0 <= value < 1 << 32 else t.INT64 if value < 0 else t.UINT64
    if isinstance(value, float):
        return t.FLOAT32
    return t.STRING
