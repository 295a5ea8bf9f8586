"""RoPE scalings read from HF configs: every scaling's frequencies and attention factor against
transformers' own RoPE init functions at real shapes, both spellings of the type key, defaults,
and typed errors."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from larql.models.config import ROPE_SCALINGS, RopeSpec
from larql.models.errors import ModelFormatError, UnsupportedArchitecture
from larql.models.gguf_loader import _rope_spec
from larql.models.hf_loader import hf_config

HEAD_DIM = 128
_DIMS = dict(
    hidden_size=1024,
    num_attention_heads=8,
    head_dim=HEAD_DIM,
    num_hidden_layers=2,
    intermediate_size=64,
    vocab_size=32,
)
_SHORT = [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)]
_LONG = [1.0 + 0.5 * i for i in range(HEAD_DIM // 2)]

# (max_position_embeddings, rope parameters) as real long-context configs write them
CASES: dict[str, tuple[int, dict[str, Any]]] = {
    "yarn (Qwen2.5)": (
        131_072,
        dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32_768),
    ),
    "yarn, mscale and betas": (
        163_840,
        dict(
            rope_type="yarn",
            rope_theta=1e4,
            factor=40.0,
            original_max_position_embeddings=4096,
            mscale=1.0,
            mscale_all_dim=0.707,
            beta_fast=16,
            beta_slow=2,
        ),
    ),
    "yarn, no truncation": (
        65_536,
        dict(
            rope_type="yarn",
            rope_theta=5e5,
            factor=8.0,
            original_max_position_embeddings=8192,
            truncate=False,
            attention_factor=1.25,
        ),
    ),
    "longrope (Phi-3.5)": (
        131_072,
        dict(
            rope_type="longrope",
            rope_theta=1e4,
            short_factor=_SHORT,
            long_factor=_LONG,
            original_max_position_embeddings=4096,
        ),
    ),
    "dynamic": (4096, dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)),
    "llama3": (
        131_072,
        dict(
            rope_type="llama3",
            rope_theta=5e5,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "linear": (4096, dict(rope_type="linear", rope_theta=1e4, factor=4.0)),
}


def raw_config(max_positions: int, rope: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    return dict(
        model_type="llama",
        max_position_embeddings=max_positions,
        rope_parameters=rope,
        **_DIMS,
        **extra,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_frequencies_and_attention_factor_match_transformers(case: str) -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    max_positions, rope = CASES[case]
    theirs_config = LlamaConfig(
        **_DIMS, max_position_embeddings=max_positions, rope_parameters=dict(rope)
    )
    spec = hf_config(raw_config(max_positions, dict(rope))).layers[0].rope
    init = ROPE_INIT_FUNCTIONS[rope["rope_type"]]
    original = rope.get("original_max_position_embeddings", max_positions)
    for length in (original // 2, original, original + 1, 3 * original):
        inv_freq, attention = init(theirs_config, "cpu", seq_len=length)
        ours = spec.inv_freq(torch.tensor([length]))[0]  # [HEAD_DIM/2]
        assert ours.shape == inv_freq.shape
        assert ((ours - inv_freq.double()).abs() / ours).max().item() < 1e-6, length
        assert spec.attention_factor == pytest.approx(attention, rel=1e-12)


def test_length_dependent_frequencies_change_past_the_context() -> None:
    for case in ("dynamic", "longrope (Phi-3.5)"):
        max_positions, rope = CASES[case]
        spec = hf_config(raw_config(max_positions, dict(rope))).layers[0].rope
        at = spec.inv_freq(
            torch.tensor([1, spec.original_max_positions, spec.original_max_positions + 1])
        )
        assert spec.length_dependent
        assert torch.equal(at[0], at[1]) and not torch.equal(at[1], at[2])
        assert torch.equal(spec.inv_freq(), at[0])


@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_transformers4_form_with_either_type_key(key: str) -> None:
    scaling = {key: "yarn", "factor": 4.0, "original_max_position_embeddings": 32_768}
    raw = raw_config(131_072, None, rope_theta=1e6, rope_scaling=scaling)
    spec = hf_config(raw).layers[0].rope
    assert (spec.scaling, spec.base, spec.factor) == ("yarn", 1e6, 4.0)
    assert spec.original_max_positions == 32_768
    assert spec.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)


def test_top_level_original_context_wins_as_in_phi3() -> None:
    rope = dict(CASES["longrope (Phi-3.5)"][1], original_max_position_embeddings=131_072)
    spec = hf_config(raw_config(131_072, rope, original_max_position_embeddings=4096)).layers[0]
    assert spec.rope.original_max_positions == 4096
    # no factor given: the ratio of the contexts sets the attention factor
    expected = math.sqrt(1 + math.log(131_072 / 4096) / math.log(4096))
    assert spec.rope.attention_factor == pytest.approx(expected)


def test_dynamic_ntk_decodes_past_max_position_embeddings() -> None:
    config = hf_config(raw_config(4096, dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)))
    assert config.max_positions == 8192
    assert config.layers[0].rope.original_max_positions == 4096


def test_unknown_rope_type_names_the_supported_ones() -> None:
    raw = raw_config(4096, dict(rope_type="su", rope_theta=1e4, factor=2.0))
    with pytest.raises(UnsupportedArchitecture, match="'su'") as error:
        hf_config(raw)
    for name in ROPE_SCALINGS:
        assert name in str(error.value)
    assert {"yarn", "longrope", "dynamic"} <= set(ROPE_SCALINGS)


def test_malformed_parameters_are_format_errors() -> None:
    short = dict(CASES["longrope (Phi-3.5)"][1], short_factor=[1.0, 2.0])
    with pytest.raises(ModelFormatError, match=r"short_factor.*64"):
        hf_config(raw_config(131_072, short))
    with pytest.raises(ModelFormatError, match="'factor'"):
        hf_config(raw_config(4096, dict(rope_type="dynamic", rope_theta=1e4)))


class FakeGguf:
    """The metadata a `GgufFile` answers with, for the RoPE keys only."""

    def __init__(self, **keys: Any) -> None:
        self.architecture = "llama"
        self.path = Path("tiny.gguf")
        self.tensors: dict[str, Any] = {}
        self.keys = {name.replace("__", "."): value for name, value in keys.items()}

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        return self.keys.get(suffix, default)


def gguf_rope(**keys: Any) -> RopeSpec:
    """The RoPE of a GGUF with these `{arch}.` keys (`__` stands for a dot)."""
    return _rope_spec(FakeGguf(**keys), HEAD_DIM)  # type: ignore[arg-type]


def test_gguf_yarn_keys_map_to_the_same_rope_as_the_hf_config() -> None:
    ours = gguf_rope(
        rope__freq_base=1e6,
        rope__scaling__type="yarn",
        rope__scaling__factor=4.0,
        rope__scaling__original_context_length=32_768,
    )
    max_positions, rope = CASES["yarn (Qwen2.5)"]
    hf = hf_config(raw_config(max_positions, dict(rope))).layers[0].rope
    assert ours == hf


def test_gguf_yarn_variants_it_cannot_follow_are_refused() -> None:
    base = dict(
        rope__scaling__type="yarn",
        rope__scaling__factor=40.0,
        rope__scaling__original_context_length=4096,
    )
    with pytest.raises(UnsupportedArchitecture, match="yarn_log_multiplier"):
        gguf_rope(**base, rope__scaling__yarn_log_multiplier=0.0707)
    del base["rope__scaling__original_context_length"]
    with pytest.raises(ModelFormatError, match="original_context_length"):
        gguf_rope(**base)
    with pytest.raises(UnsupportedArchitecture, match="supported: linear, yarn"):
        gguf_rope(rope__scaling__type="longrope")
