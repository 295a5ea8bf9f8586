"""An eviction composed with a quantiser on the quantiser's Triton kernels (`larql.kv.composed.
on_kernels`): the kept rows go into the kernel path's stores, laid out by their count while RoPE
keeps the tokens' positions, and decode gives the logits, rows and bytes of the same composition
on the torch path (the quantiser's `attention=sdpa`).

On a CUDA machine the kernels run compiled; on a CPU machine, in Triton's interpreter over the
default model's first layers (tests/conftest.py turns it on); without Triton these tests skip."""

from __future__ import annotations

import pytest
import torch

import larql.kernels
from helpers import (
    greedy_streams,
    kernel_module,
    model_for_kernels,
    prefilled_engine,
    relative_error,
    teacher_forced,
)
from larql.inference.engine import KvEngine
from larql.inference.ffn import DenseFfn
from larql.kv import captured_step, parse_engine
from larql.kv.composed.storage import KeptCodes
from larql.kv.turbo_quant.kernel_path import KernelPath
from larql.models import Model
from tiny_models import random_ids

CUDA = torch.cuda.is_available()
TEXT = "Alice put the red ball in the box, and Bob took it out again and then " * 3


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    kernel_module("larql.kv.turbo_quant.kernels")  # skips without Triton


def on_torch_path(spec: str) -> str:
    """The same composition with its quantiser on the torch path."""
    return spec.replace("-quant:bits=", "-quant:attention=sdpa,bits=")


@pytest.mark.parametrize(
    "spec",
    ["snapkv:keep=0.5,window=4+turbo-quant:bits=4", "keydiff:keep=0.25+kv-quant:bits=4"],
)
@pytest.mark.slow
def test_kernel_path_decodes_as_the_torch_path(spec: str, smollm2: Model, monkeypatch) -> None:
    """Fewer rows held than the position: the same logits, rows and bytes as the torch path."""
    model = model_for_kernels(smollm2, monkeypatch, interpreted_layers=1)
    ids = model.tokenizer.encode(TEXT)
    prompt = len(ids) - 5
    ours = teacher_forced(model, spec, ids, prompt)
    reference = teacher_forced(model, on_torch_path(spec), ids, prompt)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    assert relative_error(ours, reference) <= 1e-4
    specs = (spec, on_torch_path(spec))
    fast, torch_path = (prefilled_engine(s, model, ids[:prompt]) for s in specs)
    path = fast._fast  # type: ignore[attr-defined]
    assert isinstance(path, KernelPath) and path.shifted
    assert fast._layers == [None] * model.config.num_layers  # type: ignore[attr-defined]
    assert all(isinstance(layer, KeptCodes) for layer in torch_path._layers)  # type: ignore[attr-defined]
    for layer in range(model.config.num_layers):
        kept = torch_path._layers[layer]  # type: ignore[attr-defined]
        assert path.stored_rows(layer) == len(kept) < prompt
    assert fast.memory().state == torch_path.memory().state
    assert fast.window_tokens() == torch_path.window_tokens()
    assert "triton kernels" in fast.info().description
    assert "triton kernels" not in torch_path.info().description
    assert fast.dispatch_path() == ("cuda-graph" if CUDA else "static")


@pytest.mark.slow
def test_sessions_batched_give_their_tokens_alone(smollm2: Model, monkeypatch) -> None:
    """Three sessions of other prompt lengths (so other rows kept, other offsets) decoded in one
    batched step — the codec's batched launches, each layer laid out by each session's rows —
    get the tokens and logits they get alone; the same composition on the torch path, or the
    quantiser alone, never shares their step (the batch keys differ)."""
    model = model_for_kernels(smollm2, monkeypatch, interpreted_layers=1)
    # (kv-quant's launches: turbo-quant's batched ones are those its own batching test runs)
    spec = "snapkv:keep=0.5,window=4+kv-quant:bits=4"
    prompts = [TEXT, TEXT[:60], TEXT[:100]]
    alone = [parse_engine(spec).build(model) for _ in prompts]
    alone_tokens, alone_logits = greedy_streams(model, alone, prompts, 4, batched=False)
    engines = [parse_engine(spec).build(model) for _ in prompts]
    tokens, logits = greedy_streams(model, engines, prompts, 4, batched=True)
    paths = [e._fast for e in engines]  # type: ignore[attr-defined]
    assert all(isinstance(p, KernelPath) and p.shifted for p in paths)
    assert len({tuple(p.offsets) for p in paths}) == 3
    assert tokens == alone_tokens
    assert torch.allclose(logits, alone_logits, atol=1e-3, rtol=0)
    ids = model.tokenizer.encode(TEXT)
    for other in (on_torch_path(spec), "kv-quant:bits=4"):
        assert prefilled_engine(other, model, ids).batch_key() != engines[0].batch_key()


@pytest.mark.slow
def test_a_prompt_in_parts_ends_on_the_kernel_path(smollm2: Model, monkeypatch) -> None:
    """The layers kept one turn at a time (`finish_prompt`) go into the path with the last:
    the next step's logits are those after one whole prefill."""
    model = model_for_kernels(smollm2, monkeypatch)
    spec = "snapkv:keep=0.5,window=4+kv-quant:bits=4"
    ids = model.tokenizer.encode(TEXT)
    ffn = DenseFfn(model)
    whole = prefilled_engine(spec, model, ids[:-1])
    parts = parse_engine(spec).build(model)
    assert isinstance(parts, KvEngine)
    with torch.inference_mode():
        parts.prefill_part(model, ffn, ids[:20], more=True)
        parts.prefill_part(model, ffn, ids[20:-1], more=False)
        assert not parts.finish_prompt(1)  # one layer kept: the path waits for the rest
        assert parts._fast is None  # type: ignore[attr-defined]
        assert parts.finish_prompt(100)
        assert isinstance(parts._fast, KernelPath)  # type: ignore[attr-defined]
        ours = parts.decode_step(model, ffn, ids[-1])
        reference = whole.decode_step(model, ffn, ids[-1])
    assert relative_error(ours, reference) <= 1e-5


@pytest.mark.slow
def test_rows_kept_per_head_stay_on_the_torch_path(smollm2: Model, monkeypatch) -> None:
    """`heads=adaptive` keeps another count of rows on each head: the kernels' one count a
    layer does not hold them, so the rows are coded into the torch path's stores."""
    model = model_for_kernels(smollm2, monkeypatch, interpreted_layers=1)
    engine = prefilled_engine(
        "snapkv:keep=0.5,window=4,heads=adaptive+turbo-quant:bits=4",
        model,
        model.tokenizer.encode(TEXT),
    )
    assert engine._fast is None  # type: ignore[attr-defined]
    assert "triton kernels" not in engine.info().description


@pytest.mark.slow
def test_sliding_layers_keep_their_window_while_full_layers_grow(
    tiny_gemma3_float32: Model, monkeypatch
) -> None:
    """Sliding layers hold their window by position, full layers their kept rows and then
    every decoded one (their slots doubling from a small capacity): the torch path's logits,
    rows and bytes."""
    model = tiny_gemma3_float32
    if not CUDA:
        monkeypatch.setattr(larql.kernels, "triton_available", lambda device: True)
    monkeypatch.setattr(captured_step, "MIN_CAPACITY", 4)
    monkeypatch.setattr(captured_step, "DECODE_HEADROOM", 0)
    spec = "keydiff:keep=0.5,recent=2+turbo-quant:bits=4"
    ids = random_ids(20, seed=5)
    prompt = 14
    ours = teacher_forced(model, spec, ids, prompt)
    reference = teacher_forced(model, on_torch_path(spec), ids, prompt)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    assert relative_error(ours, reference) <= 1e-4
    fast, torch_path = (prefilled_engine(s, model, ids) for s in (spec, on_torch_path(spec)))
    path = fast._fast  # type: ignore[attr-defined]
    assert isinstance(path, KernelPath) and path.shifted
    for layer, spec_of_layer in enumerate(model.config.layers):
        held = len(torch_path._layers[layer])  # type: ignore[attr-defined]
        assert path.stored_rows(layer) == held
        if spec_of_layer.sliding_window is None:
            assert held < len(ids)  # evicted
    assert fast.memory().state == torch_path.memory().state
