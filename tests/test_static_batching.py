"""`standard`'s static (CUDA graph) path batched: several sessions, each with its own static
cache at its own length and capacity, decode in one step and get the tokens they get alone —
eagerly (no kernel: each row's attention through `attend_static`) and through the batched
decode-attention kernel (compiled on CUDA, in Triton's interpreter on a CPU machine), whose
output for each session equals the one-session kernel's."""

from __future__ import annotations

import pytest
import torch

import larql.kv.standard.static as static_module
from helpers import first_layers, greedy_streams, kernel_module, model_for_kernels
from larql.inference.batching import batch_groups
from larql.inference.ffn import DenseFfn
from larql.kv.captured_step import bucket, next_power_of_two
from larql.kv.standard import StandardEngine
from larql.models import Model

PROMPTS = ["The capital of France is", "Alice put the red ball in the box, and Bob", "One two"]


def _decode(
    model: Model, engines: list[StandardEngine], steps: int, batched: bool
) -> tuple[list[list[int]], torch.Tensor]:
    return greedy_streams(model, engines, PROMPTS, steps, batched)


def _static_engines(window: int | None = None) -> list[StandardEngine]:
    return [StandardEngine(window=window, static=True) for _ in PROMPTS]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.slow
def test_static_sessions_batched_give_their_tokens_alone(smollm2: Model, window) -> None:
    model = first_layers(smollm2, 4)  # real weights and heads; the batching is depth-blind
    engines = _static_engines(window)
    alone_tokens, alone_logits = _decode(model, engines, 8, batched=False)
    engines = _static_engines(window)
    batched_tokens, batched_logits = _decode(model, engines, 8, batched=True)
    assert batched_tokens == alone_tokens
    assert len({tuple(t) for t in batched_tokens}) == len(PROMPTS)
    assert torch.allclose(batched_logits, alone_logits, atol=1e-3, rtol=0)


def test_static_engines_batch_only_with_their_own_path(smollm2: Model) -> None:
    ffn = DenseFfn(smollm2)
    ids = smollm2.tokenizer.encode(PROMPTS[0])
    engines = [StandardEngine(static=True), StandardEngine(), StandardEngine(static=True)]
    engines.append(StandardEngine(window=6, static=True))
    for engine in engines:
        engine.prefill(smollm2, ffn, ids)
    assert batch_groups(engines) == [[0, 2], [1], [3]]


@pytest.mark.slow
def test_the_batch_kernel_gives_each_session_its_own_attention(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sessions of three lengths whose caches grow at different steps (first capacity just
    above the prompt) batch through the kernel with their tokens alone."""
    kernel_module("larql.kernels.batched_decode_attention")
    model = model_for_kernels(smollm2, monkeypatch, interpreted_layers=2)
    monkeypatch.setattr(static_module, "initial_capacity", lambda n: next_power_of_two(n + 1))
    # 4 steps: the 5- and 2-token sessions' caches (8 and 4 rows) grow, the 11-token one's not
    alone_tokens, alone_logits = _decode(model, _static_engines(), 4, batched=False)
    engines = _static_engines()
    batched_tokens, batched_logits = _decode(model, engines, 4, batched=True)
    assert batched_tokens == alone_tokens
    assert torch.allclose(batched_logits, alone_logits, atol=1e-4, rtol=0)
    capacities = {e.fast_path.capacity for e in engines if e.fast_path is not None}
    assert len(capacities) > 1  # the sessions' caches grew apart


def test_batch_sizes_round_up_to_a_captured_bucket() -> None:
    assert [bucket(n) for n in (1, 2, 3, 5, 16, 17, 64, 65, 130)] == [
        1,
        2,
        4,
        8,
        16,
        32,
        64,
        128,
        192,
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_path_sessions_batched_give_their_tokens_alone_on_cuda() -> None:
    """The captured graphs per batch size (3 sessions: the bucket of 4, one pad row)."""
    from larql.models.model import load_model

    model = load_model("smollm2-135m", dtype=torch.float32, device="cuda")
    engines = [StandardEngine() for _ in PROMPTS]
    alone_tokens, alone_logits = _decode(model, engines, 24, batched=False)
    engines = [StandardEngine() for _ in PROMPTS]
    batched_tokens, batched_logits = _decode(model, engines, 24, batched=True)
    assert batched_tokens == alone_tokens
    assert torch.allclose(batched_logits, alone_logits, atol=1e-3, rtol=0)
