"""GGUF files of qwen2, qwen3, mistral-style llama (sliding window), phi3, granite and the
mixtures of experts (Mixtral as llama, qwen2moe, qwen3moe, gpt-oss), written from tiny
random transformers models with the `gguf` package's writer: larql's logits and greedy tokens
against transformers on the same weights, the tokenizer rebuilt from the file against the one
it was written from, and the file's chat template."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import full_forward_logits, teacher_forced
from hf_oracle import hf_greedy
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate
from larql.kv import parse_engine
from larql.models import Model, load_model
from larql.models.errors import UnsupportedArchitecture
from larql.models.gguf_file import GgufFile
from larql.models.gguf_loader import gguf_block_rows, gguf_config, gguf_state_dict
from larql.models.tokenizer import tokenizer_from_gguf
from tiny_gguf import (
    byte_level_gguf_tokenizer,
    qwen2_reference_tokenizer,
    word_gguf_tokenizer,
    write_gguf,
)
from tiny_models import WINDOW, random_hf_model, random_ids

transformers = pytest.importorskip("transformers")

TOL = 1e-4
SEQ = 24  # > 4 × the tiny window
STEPS = 16
VOCAB = 320  # room for a byte-level BPE: 256 bytes, some merges, the special tokens


@dataclass(frozen=True)
class GgufCase:
    gguf_arch: str
    model_type: str
    config: dict[str, Any]
    permute_qk: bool = False  # llama.cpp's llama layout
    sliding_window: int | None = None
    rotary_dim: int | None = None
    larql_arch: str | None = None  # the architecture larql names it (None: gguf_arch)


CASES = {
    "qwen2": GgufCase("qwen2", "qwen2", dict(tie_word_embeddings=True)),
    "qwen3": GgufCase("qwen3", "qwen3", dict(tie_word_embeddings=False)),
    "mistral-as-llama": GgufCase(
        "llama",
        "mistral",
        dict(sliding_window=WINDOW, tie_word_embeddings=False),
        permute_qk=True,
        sliding_window=WINDOW,
    ),
    # mixture-of-experts: llama.cpp writes Mixtral as llama with stacked experts
    "mixtral-as-llama": GgufCase(
        "llama",
        "mixtral",
        dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
        permute_qk=True,
    ),
    "qwen2moe": GgufCase(
        "qwen2moe",
        "qwen2_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
        larql_arch="qwen2_moe",
    ),
    "qwen3moe": GgufCase(
        "qwen3moe",
        "qwen3_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        larql_arch="qwen3_moe",
    ),
    # embedding, residual, attention and logit multipliers (llama's layout otherwise)
    "granite": GgufCase(
        "granite",
        "granite",
        dict(
            embedding_multiplier=6.0,
            residual_multiplier=0.5,
            attention_multiplier=0.05,
            logits_scaling=4.0,
            tie_word_embeddings=False,
        ),
        permute_qk=True,
    ),
    # attention sinks, even layers sliding, experts with biases (llama.cpp's gpt-oss layout)
    "gpt-oss": GgufCase(
        "gpt-oss",
        "gpt_oss",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 2,
            swiglu_limit=7.0,
            rope_parameters=dict(rope_type="default", rope_theta=10_000.0),
            tie_word_embeddings=False,
        ),
        sliding_window=WINDOW,
        larql_arch="gpt_oss",
    ),
    "phi3": GgufCase(
        "phi3",
        "phi3",
        dict(
            sliding_window=WINDOW,
            partial_rotary_factor=0.5,
            tie_word_embeddings=False,
            pad_token_id=0,
        ),
        sliding_window=WINDOW,
        rotary_dim=6,
    ),
}


@dataclass
class TinyGguf:
    case: GgufCase
    path: Path
    hf_model: Any

    @torch.no_grad()
    def hf_logits(self, ids: list[int]) -> torch.Tensor:
        return self.hf_model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module", autouse=True)
def fresh_cache(tmp_path_factory: pytest.TempPathFactory):
    """The files here are the same bytes every run: a user cache would answer for the loader."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LARQL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def qwen_tokenizer():
    return qwen2_reference_tokenizer(VOCAB - 40)


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer):
    case = CASES[request.param]
    model = random_hf_model(case.model_type, vocab_size=VOCAB, **case.config)
    if case.gguf_arch == "phi3":
        tok = word_gguf_tokenizer(VOCAB)
    else:
        tok = byte_level_gguf_tokenizer(qwen_tokenizer, VOCAB, pre="qwen2")
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf"
    write_gguf(
        model,
        case.gguf_arch,
        path,
        tok,
        permute_qk=case.permute_qk,
        sliding_window=case.sliding_window,
        rotary_dim=case.rotary_dim,
    )
    return TinyGguf(case, path, model)


def larql_greedy(model: Model, ids: list[int], n: int) -> list[int]:
    engine = parse_engine("standard").build(model)
    return generate(engine, model, DenseFfn(model), ids, n, stop_ids=frozenset()).tokens


def test_config_reads_the_file(tiny: TinyGguf) -> None:
    config = load_model(str(tiny.path)).config
    hf = tiny.hf_model.config
    assert config.arch.name == (tiny.case.larql_arch or tiny.case.gguf_arch)
    experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None)
    routing = config.experts
    assert (routing.num_experts, routing.top_k) == (experts, 2) if experts else routing is None
    if experts:  # the widths tensor parallelism splits, read from the tensor table
        width = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
        shared = getattr(hf, "shared_expert_intermediate_size", None) or 0
        assert (routing.expert_width, routing.shared_width) == (width, shared)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.num_hidden_layers,
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf.head_dim,
    )
    types = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    window = tiny.case.sliding_window
    expected = [window if kind == "sliding_attention" else None for kind in types]
    assert [spec.sliding_window for spec in config.layers] == expected
    rotary = tiny.case.rotary_dim or hf.head_dim
    assert {spec.rope.rotary_dim for spec in config.layers} == {rotary}


def test_full_forward_matches_transformers(tiny: TinyGguf) -> None:
    ids = random_ids(SEQ)
    ours = full_forward_logits(load_model(str(tiny.path)), ids)
    theirs = tiny.hf_logits(ids)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < TOL


def test_standard_engine_decode_matches_transformers(tiny: TinyGguf) -> None:
    ids = random_ids(SEQ, seed=2)
    prompt = 8
    ours = teacher_forced(load_model(str(tiny.path)), "standard", ids, prompt)
    assert (ours - tiny.hf_logits(ids)[prompt - 1 :]).abs().max().item() < TOL


def test_greedy_tokens_match_transformers(tiny: TinyGguf) -> None:
    ids = random_ids(10, seed=3)
    ours = larql_greedy(load_model(str(tiny.path)), ids, STEPS)
    assert ours == hf_greedy(tiny.hf_model, ids, STEPS)


def test_sliding_window_matters(tiny: TinyGguf) -> None:
    """The file's window really applies: dropping it moves the logits away from transformers'."""
    if tiny.case.sliding_window is None:
        pytest.skip(f"{tiny.case.gguf_arch} file has no window")
    model = load_model(str(tiny.path))
    layers = tuple(replace(spec, sliding_window=None) for spec in model.config.layers)
    model.config = replace(model.config, layers=layers)
    ids = random_ids(SEQ)
    assert (full_forward_logits(model, ids) - tiny.hf_logits(ids)).abs().max().item() > 1e-3


TEXTS = [
    "The quick brown fox (jumps) over 12345 lazy dogs.",
    "I'M sure they'LL say IT'S fine; $prices and #tags @you",
    "Cafe\u0301 and café, naïve Zürich — 日本語 🙂",
    "def f(x):\n    return x ** 2  # square\n\n\ttabs\r\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


def test_qwen2_tokenizer_matches_the_one_it_was_written_from(
    tmp_path: Path, qwen_tokenizer
) -> None:
    model = random_hf_model("qwen2", vocab_size=VOCAB, num_hidden_layers=1)
    ours = {}
    for pre in ("qwen2", "default"):
        tok = byte_level_gguf_tokenizer(qwen_tokenizer, VOCAB, pre=pre)
        path = write_gguf(model, "qwen2", tmp_path / f"{pre}.gguf", tok)
        ours[pre] = tokenizer_from_gguf(GgufFile(path))
    for text in TEXTS:
        ids = ours["qwen2"].encode(text).ids
        assert ids == qwen_tokenizer.encode(text).ids, text
        assert ours["qwen2"].decode(ids) == qwen_tokenizer.decode(ids)
    # GPT-2's split (what a file without Qwen's `pre` gets) cuts some of these texts elsewhere
    assert any(ours["default"].encode(t).ids != qwen_tokenizer.encode(t).ids for t in TEXTS)


def test_chat_template_from_the_file(tiny: TinyGguf, qwen_tokenizer) -> None:
    model = load_model(str(tiny.path))
    if tiny.case.gguf_arch == "phi3":
        pytest.skip("phi3's template: test_phi3_chat_template")
    messages = [{"role": "user", "content": "Hi (there) 42"}]
    text = "<|im_start|>user\nHi (there) 42<|im_end|>\n<|im_start|>assistant\n"
    assert model.tokenizer.render_chat(messages) == text
    assert model.tokenizer.encode_chat(messages) == qwen_tokenizer.encode(text).ids
    assert qwen_tokenizer.token_to_id("<|im_end|>") in model.tokenizer.stop_ids


def test_phi3_sentencepiece_vocabulary(tiny: TinyGguf) -> None:
    if tiny.case.gguf_arch != "phi3":
        pytest.skip("phi3 only")
    tok = load_model(str(tiny.path)).tokenizer
    words = ["▁w5", "▁w0", "▁w9"]
    ids = [1, *(word_gguf_tokenizer(VOCAB).tokens.index(w) for w in words)]
    assert tok.encode(" w5 w0 w9") == ids
    assert tok.decode(ids, skip_special_tokens=True) == " w5 w0 w9"


def test_phi3_chat_template(tiny: TinyGguf) -> None:
    if tiny.case.gguf_arch != "phi3":
        pytest.skip("phi3 only")
    tok = load_model(str(tiny.path)).tokenizer
    messages = [{"role": "user", "content": " w5 w0"}]
    text = "<|user|>\n w5 w0<|end|>\n<|assistant|>\n"
    assert tok.render_chat(messages) == text
    vocab = word_gguf_tokenizer(VOCAB).tokens
    pieces = ["<|user|>", "<0x0A>", "▁w5", "▁w0", "<|end|>", "<0x0A>", "<|assistant|>", "<0x0A>"]
    assert tok.encode_chat(messages) == [vocab.index(p) for p in pieces]
    assert vocab.index("<|end|>") in tok.stop_ids  # Phi-3 ends a turn with it


@pytest.mark.parametrize("name", ["mistral-as-llama", "phi3", "granite"])
def test_block_rows_are_the_float_rows(name: str, tmp_path: Path) -> None:
    """Q8_0 matrices kept in their blocks hold the rows the float path has, split (Phi-3's
    fused matrices) and un-permuted (llama's Q/K) alike; Granite's residual multiplier scales
    its output and down projections at load, so those stay on the float path."""
    case = CASES[name]
    shape = dict(hidden_size=64, intermediate_size=96, head_dim=16)  # widths of 32·n
    model = random_hf_model(case.model_type, vocab_size=VOCAB, **{**case.config, **shape})
    path = write_gguf(
        model,
        case.gguf_arch,
        tmp_path / "q8.gguf",
        word_gguf_tokenizer(VOCAB),
        permute_qk=case.permute_qk,
        rotary_dim=8,
        q8_0=True,
    )
    file = GgufFile(path)
    config = gguf_config(file)
    blocks = gguf_block_rows(file, config)
    state = gguf_state_dict(file, config)
    assert {"layers.0.wq", "layers.0.wk", "layers.0.w_gate", "layers.0.w_up"} <= set(blocks)
    assert ("layers.0.wo" in blocks) == (name != "granite")
    for canonical, rows in blocks.items():
        assert torch.equal(rows.dequantize(), state[canonical]), canonical


def test_unknown_gguf_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    model = random_hf_model("qwen2", vocab_size=VOCAB, num_hidden_layers=1)
    path = write_gguf(model, "falcon", tmp_path / "f.gguf", word_gguf_tokenizer(VOCAB))
    supported = "gpt-oss, granite, llama, phi3, qwen2, qwen2moe, qwen3, qwen3moe"
    with pytest.raises(UnsupportedArchitecture, match=supported):
        load_model(str(path))


def test_q4_k_matrices_decode_through_their_blocks(tmp_path: Path) -> None:
    """A llama GGUF whose matrices are Q4_K: kept as blocks of 32 (repacked), read by the CPU
    kernels in a decode step, with the float path's greedy tokens (the file's weights are the
    Q4_K bytes; the float path dequantises them)."""
    from larql.kernels.cpu import cpu_extension

    if cpu_extension() is None:
        pytest.skip("the CPU block kernels are not built")
    shape = dict(
        hidden_size=256,
        intermediate_size=512,
        head_dim=32,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    model = random_hf_model("llama", vocab_size=VOCAB, **shape)
    path = write_gguf(
        model,
        "llama",
        tmp_path / "q4k.gguf",
        word_gguf_tokenizer(VOCAB),
        permute_qk=True,
        q4_k=True,
    )
    blocks = load_model(str(path), weights="blocks-float")
    floats = load_model(str(path), weights="float")
    assert {b.format for b in blocks.weights.layers[0].blocks.values()} == {"q4_k32"}
    assert blocks.weights.lm_head_blocks is not None
    prompt = random_ids(12, seed=3)
    runs = []
    for m in (floats, blocks, load_model(str(path))):  # the last: auto, int16 products
        engine = parse_engine("standard").build(m)
        result = generate(engine, m, DenseFfn(m), prompt, 16, stop_ids=frozenset())
        runs.append(result.tokens)
    assert len(runs[0]) == 16 and runs[0] == runs[1] == runs[2]


def test_gpt_oss_mxfp4_experts(tmp_path: Path, qwen_tokenizer) -> None:
    """GPT-OSS as llama.cpp ships it, the experts in MXFP4: the file's weights (what the `gguf`
    package decodes them to) against transformers holding the same."""
    case = CASES["gpt-oss"]
    shape = dict(hidden_size=64, intermediate_size=64, head_dim=16)  # expert widths of 32·n
    model = random_hf_model(case.model_type, vocab_size=VOCAB, **{**case.config, **shape})
    tok = byte_level_gguf_tokenizer(qwen_tokenizer, VOCAB, pre="qwen2")
    path = write_gguf(
        model,
        "gpt-oss",
        tmp_path / "mxfp4.gguf",
        tok,
        mxfp4=True,
        sliding_window=case.sliding_window,
    )
    file = GgufFile(path)
    assert {file.tensors[n].qtype.name for n in file.tensors if "_exps.weight" in n} == {"MXFP4"}
    experts = dict(model.named_parameters())
    with torch.no_grad():
        for layer in range(model.config.num_hidden_layers):
            blk, name = f"blk.{layer}", f"model.layers.{layer}.mlp.experts."
            gate, up, down = (
                torch.from_numpy(file.dequantize(f"{blk}.ffn_{m}_exps.weight"))
                for m in ("gate", "up", "down")
            )
            fused = experts[name + "gate_up_proj"]  # [E, H, 2F], gate and up alternating
            fused[..., 0::2] = gate.transpose(1, 2)
            fused[..., 1::2] = up.transpose(1, 2)
            experts[name + "down_proj"].copy_(down.transpose(1, 2))
    ids = random_ids(SEQ)
    ours = full_forward_logits(load_model(str(path)), ids)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() < TOL
