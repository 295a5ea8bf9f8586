"""docs/DESIGN.md decision 1 on the real default model: the exact engines agree with `standard`
(≤1e-9 relative logits in float64; identical greedy tokens in float32), and `standard:window=N`
equals a band-masked full forward pass."""

from __future__ import annotations

import pytest
import torch

from helpers import full_forward_logits, relative_error, teacher_forced
from larql.inference.ffn import DenseFfn
from larql.inference.forward import run_layers
from larql.inference.generation import generate
from larql.inference.layer import embed, final_logits, token_tensor
from larql.kv import parse_engine
from larql.models import Model

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.mark.slow
def test_no_cache_matches_standard_in_float64(smollm2_f64: Model) -> None:
    ids = smollm2_f64.tokenizer.encode(PROMPT)  # 10 tokens: 5 decode steps after 5
    standard = teacher_forced(smollm2_f64, "standard", ids, 5)
    no_cache = teacher_forced(smollm2_f64, "no-cache", ids, 5)
    assert standard.dtype == torch.float64
    assert relative_error(no_cache, standard) <= 1e-9


@pytest.mark.long  # test_engine_compliance.py's greedy test runs no-cache for 32 tokens too
def test_no_cache_greedy_tokens_match_standard_in_float32(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(PROMPT)
    ffn = DenseFfn(smollm2)
    runs = {}
    for spec in ("standard", "no-cache"):
        engine = parse_engine(spec).build(smollm2)
        runs[spec] = generate(engine, smollm2, ffn, ids, 32, stop_ids=frozenset()).tokens
    assert len(runs["standard"]) == 32
    assert runs["no-cache"] == runs["standard"]


# long: the float64 test above checks the same no-cache = standard relation (to 1e-9), and
# test_engine_compliance's greedy test runs no-cache in float32 for 32 tokens
@pytest.mark.long
def test_no_cache_float32_logits_within_1e3(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(PROMPT + " and then")
    standard = teacher_forced(smollm2, "standard", ids, 4)
    no_cache = teacher_forced(smollm2, "no-cache", ids, 4)
    assert (standard - no_cache).abs().max().item() <= 1e-3


def band_masked_logits(model: Model, ids: list[int], window: int) -> torch.Tensor:
    with torch.inference_mode():
        h = run_layers(
            model, DenseFfn(model), embed(model, token_tensor(model, ids)), window=window
        )
        return final_logits(model, h)


def test_windowed_standard_equals_band_masked_forward(smollm2_f64: Model) -> None:
    window = 4
    ids = smollm2_f64.tokenizer.encode(PROMPT + " it was tired")
    prompt_len = 7  # longer than the window: prefill itself is band-masked
    engine_rows = teacher_forced(smollm2_f64, f"standard:window={window}", ids, prompt_len)
    oracle = full_forward_logits(smollm2_f64, ids, window)[prompt_len - 1 :]
    assert relative_error(engine_rows, oracle) <= 1e-9
    unwindowed = teacher_forced(smollm2_f64, "standard", ids, prompt_len)
    assert relative_error(unwindowed, oracle) > 1e-3  # the window really changes the output


def test_window_keeps_only_reachable_rows(smollm2: Model) -> None:
    engine = parse_engine("standard:window=4").build(smollm2)
    ffn = DenseFfn(smollm2)
    with torch.inference_mode():
        engine.prefill(smollm2, ffn, smollm2.tokenizer.encode(PROMPT))
        for token in (11, 12, 13):
            engine.decode_step(smollm2, ffn, token)
    assert engine.window_tokens() == 3  # window − 1 prior rows; the next token is the 4th key
