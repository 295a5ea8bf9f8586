"""`standard:window=N,sinks=S` (StreamingLLM): the first S rows stay visible to every query."""

from __future__ import annotations

import pytest
import torch

from helpers import relative_error, teacher_forced
from larql.kv import parse_engine
from larql.kv.spec import EngineSpecError
from larql.kv.standard.sinks import SinkKvBuffer
from larql.models import Model

PROMPT = "The quick brown fox jumps over the lazy dog because it was tired of waiting"


def test_sink_rows_survive_a_thousand_steps() -> None:
    buffer = SinkKvBuffer(sinks=4, window=8)
    prompt = torch.arange(6, dtype=torch.float64).view(1, 6, 1)  # [Hkv, S, D]: value = position
    buffer.append(prompt, prompt)
    buffer.clip()
    for position in range(6, 1006):
        row = torch.full((1, 1, 1), float(position), dtype=torch.float64)
        keys, _ = buffer.append(row, row)
        assert keys[0, :4, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
        window = range(max(4, position - 7), position + 1)  # never a sink twice
        assert keys[0, 4:, 0].tolist() == [float(p) for p in window]
        buffer.clip()
    assert buffer.positions().tolist() == [0, 1, 2, 3, *range(999, 1006)]


@pytest.mark.slow
def test_prefill_mask_equals_step_by_step_eviction(smollm2_f64: Model) -> None:
    """The prefill's band-plus-sinks mask and the decode's kept rows are one rule."""
    ids = smollm2_f64.tokenizer.encode(PROMPT)
    spec = "standard:window=4,sinks=2"
    prefilled = teacher_forced(smollm2_f64, spec, ids, 10)  # rows predict ids[10:]
    stepped = teacher_forced(smollm2_f64, spec, ids, 1)[9:]
    assert relative_error(prefilled, stepped) <= 1e-9
    window_only = teacher_forced(smollm2_f64, "standard:window=4", ids, 10)
    assert relative_error(prefilled, window_only) > 1e-3  # the sinks change what is seen


@pytest.mark.slow
def test_sinks_covering_the_text_equal_the_full_cache(smollm2_f64: Model) -> None:
    ids = smollm2_f64.tokenizer.encode(PROMPT)
    with_sinks = teacher_forced(smollm2_f64, f"standard:window=2,sinks={len(ids)}", ids, 5)
    full = teacher_forced(smollm2_f64, "standard", ids, 5)
    assert relative_error(with_sinks, full) <= 1e-9


def test_sinks_need_a_window(smollm2: Model) -> None:
    with pytest.raises(EngineSpecError, match="needs window"):
        parse_engine("standard:sinks=4").build(smollm2)
    with pytest.raises(EngineSpecError):
        parse_engine("standard:window=8,sinks=-1")
