"""Small helpers the test modules share."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

import pytest
import torch

import larql.kernels
from larql.inference.batching import decode_batch
from larql.inference.engine import KvEngine
from larql.inference.ffn import DenseFfn
from larql.inference.forward import run_layers
from larql.inference.generation import next_token_logits, teacher_forced_logits
from larql.inference.layer import embed_rows, final_logits, token_tensor
from larql.kv import parse_engine
from larql.models import Model
from larql.models.model import load_model


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to `count` inside the block (the suite's workers run one
    thread each, so the compiled kernels' split over threads runs only where a test asks)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def teacher_forced(model: Model, spec: str, ids: list[int], prompt_len: int) -> torch.Tensor:
    """Logits of engine `spec` after ids[:prompt_len] and after each later id: [N, V]."""
    engine = parse_engine(spec).build(model)
    return teacher_forced_logits(engine, model, DenseFfn(model), ids, prompt_len)


def full_forward_logits(model: Model, ids: list[int], window: int | None = None) -> torch.Tensor:
    """Logits of every position from one stateless forward pass: [S, V]."""
    with torch.inference_mode():
        h, inputs = embed_rows(model, token_tensor(model, ids))
        h = run_layers(model, DenseFfn(model), h, window=window, inputs=inputs)
        return final_logits(model, h)


def relative_error(a: torch.Tensor, reference: torch.Tensor) -> float:
    return ((a - reference).abs().max() / reference.abs().max()).item()


def kernel_module(name: str) -> ModuleType:
    """The Triton kernel module `name`: compiled on a CUDA machine, in Triton's interpreter on a
    CPU one (tests/conftest.py turns it on before anything imports Triton); skips without
    Triton."""
    pytest.importorskip("triton")
    assert torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    return importlib.import_module(name)


def model_for_kernels(
    cpu_model: Model, monkeypatch: pytest.MonkeyPatch, interpreted_layers: int = 2
) -> Model:
    """The default model (float32) where engines will use the Triton kernels: on CUDA, the whole
    model; on a CPU machine its first `interpreted_layers` layers (Triton's interpreter runs a
    launch thousands of times slower than a GPU; the layers are alike, the heads are real),
    with the kernels let run there."""
    if torch.cuda.is_available():
        return load_model("smollm2-135m", dtype=torch.float32, device="cuda")
    monkeypatch.setattr(larql.kernels, "triton_available", lambda device: True)
    return first_layers(cpu_model, interpreted_layers)


def steps_on_shared_state(
    model: Model,
    ids: list[int],
    prompt_len: int,
    leader: KvEngine,
    follower_of: Callable[[KvEngine], KvEngine],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced decode steps of `leader`, and of a follower that takes each step from the
    very state the leader holds before it (`follower_of(leader)`, built afresh every step) →
    both step logits [len(ids) − prompt_len, V].

    Two lossy paths compared over a whole teacher-forced run drift apart through their stores:
    a float32 rounding difference moves a value across a quantisation boundary, the row is
    stored differently and every later step differs. Stepping from one shared state leaves
    only what the two steps compute."""
    ffn = DenseFfn(model)
    ours, theirs = [], []
    with torch.inference_mode():
        leader.prefill(model, ffn, ids[:prompt_len])
        for token in ids[prompt_len:]:
            follower = follower_of(leader)
            theirs.append(next_token_logits(model, follower.decode_step(model, ffn, token)))
            ours.append(next_token_logits(model, leader.decode_step(model, ffn, token)))
    return torch.stack(ours), torch.stack(theirs)


def first_layers(model: Model, n: int) -> Model:
    """The model cut to its first `n` layers: its real weights, tokenizer and head shapes at a
    fraction of the cost (for the kernels' tests in Triton's interpreter)."""
    config = dataclasses.replace(model.config, num_layers=n, layers=model.config.layers[:n])
    weights = dataclasses.replace(model.weights, layers=model.weights.layers[:n])
    return Model(model.name, model.source, config, weights, model.tokenizer)


def forget_package(top: str) -> None:
    """Drop the imported modules of package `top`, so the next import reads it from the path
    (two tests install one plugin package from two places)."""
    for name in [m for m in sys.modules if m.split(".")[0] == top]:
        del sys.modules[name]


def greedy_streams(
    model: Model, engines: list, prompts: list[str], steps: int, batched: bool
) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy steps of every engine after its prompt, all in one batched step each time
    (`decode_batch`) or one engine after another → (tokens per engine, logits [steps, B, V])."""
    ffn = DenseFfn(model)
    with torch.inference_mode():
        last = []
        for engine, prompt in zip(engines, prompts, strict=True):
            hidden = engine.prefill(model, ffn, model.tokenizer.encode(prompt))
            last.append(int(final_logits(model, hidden[-1:]).argmax()))
        tokens = [[t] for t in last]
        logits = []
        for _ in range(steps):
            if batched:
                hidden = decode_batch(engines, model, ffn, last)
            else:
                pairs = zip(engines, last, strict=True)
                hidden = torch.cat([e.decode_step(model, ffn, t) for e, t in pairs])
            step_logits = final_logits(model, hidden)  # [B, V]
            logits.append(step_logits)
            last = step_logits.argmax(-1).tolist()
            for stream, token in zip(tokens, last, strict=True):
                stream.append(token)
    return tokens, torch.stack(logits)


def prefilled_engine(spec: str, model: Model, ids: list[int]) -> KvEngine:
    """An engine of `spec` after the prompt `ids`."""
    engine = parse_engine(spec).build(model)
    assert isinstance(engine, KvEngine)
    with torch.inference_mode():
        engine.prefill(model, DenseFfn(model), ids)
    return engine
