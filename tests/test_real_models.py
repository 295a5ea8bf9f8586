"""The real GGUF models against transformers (the oracle), through transformers' own GGUF loader:
tokenizer, prefill logits and greedy generation. Gemma 3 runs a prompt longer than its 512-key
sliding window so the sliding layers matter."""

from __future__ import annotations

import pytest
import torch

from helpers import full_forward_logits
from hf_oracle import SAMPLE_TEXTS, hf_greedy, hf_logits, licence_text, load_hf_gguf
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate
from larql.kv import parse_engine
from larql.models import Model

pytestmark = pytest.mark.slow
# The Gemma 3 tests are `long` (make test-all): transformers takes a minute to read the Q4_K GGUF;
# CI runs the tiny random gemma3 against transformers instead.


def larql_greedy(model: Model, ids: list[int], n: int) -> list[int]:
    engine = parse_engine("standard").build(model)
    return generate(engine, model, DenseFfn(model), ids, n, stop_ids=frozenset()).tokens


@pytest.fixture(scope="module")
def hf_smollm2(smollm2: Model):
    pytest.importorskip("transformers")
    return load_hf_gguf(smollm2.source)


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2: Model, hf_smollm2) -> None:
    _, hf_tok = hf_smollm2
    for text in [*SAMPLE_TEXTS, licence_text()[:4000]]:
        ours = smollm2.tokenizer.encode(text)
        assert ours == hf_tok.encode(text), text
        assert smollm2.tokenizer.decode(ours) == hf_tok.decode(ours)


@pytest.mark.slow
def test_smollm2_prefill_logits_match_transformers(smollm2: Model, hf_smollm2) -> None:
    hf_model, _ = hf_smollm2
    ids = smollm2.tokenizer.encode(licence_text()[:600])  # 123 tokens
    ours, theirs = full_forward_logits(smollm2, ids), hf_logits(hf_model, ids)
    assert (ours - theirs).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


# long: the prefill test above holds every position's logits (and argmax) to transformers', and
# test_hf_oracle's decode test the cached decode steps (tiny models of every architecture)
@pytest.mark.long
@pytest.mark.slow
def test_smollm2_greedy_20_tokens_match_transformers(smollm2: Model, hf_smollm2) -> None:
    hf_model, _ = hf_smollm2
    ids = smollm2.tokenizer.encode("The capital of France is")
    ours = larql_greedy(smollm2, ids, 20)
    assert ours == hf_greedy(hf_model, ids, 20)
    assert smollm2.tokenizer.decode(ours).startswith(" Paris")


@pytest.fixture(scope="module")
def hf_gemma3(gemma3: Model):
    pytest.importorskip("transformers")
    return load_hf_gguf(gemma3.source)


@pytest.mark.gemma
@pytest.mark.long
def test_gemma3_tokenizer_matches_transformers(gemma3: Model, hf_gemma3) -> None:
    _, hf_tok = hf_gemma3
    for text in [*SAMPLE_TEXTS, licence_text()[:4000]]:
        assert gemma3.tokenizer.encode(text) == hf_tok.encode(text), text


@pytest.mark.gemma
@pytest.mark.long
def test_gemma3_long_prompt_logits_match_transformers(gemma3: Model, hf_gemma3) -> None:
    hf_model, _ = hf_gemma3
    ids = gemma3.tokenizer.encode(licence_text())[:700]
    assert len(ids) > 512 + 100  # past the sliding window
    ours, theirs = full_forward_logits(gemma3, ids), hf_logits(hf_model, ids)
    assert (ours - theirs).abs().max().item() < 2e-3
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.gemma
@pytest.mark.long
def test_gemma3_engine_decode_past_window_matches_transformers(gemma3: Model, hf_gemma3) -> None:
    hf_model, _ = hf_gemma3
    ids = gemma3.tokenizer.encode(licence_text())[:540]
    ours = larql_greedy(gemma3, ids, 8)
    assert ours == hf_greedy(hf_model, ids, 8)
