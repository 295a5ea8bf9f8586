"""Small helpers the test modules share."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch

import larql.kernels
from larql.inference.ffn import DenseFfn
from larql.inference.forward import run_layers
from larql.inference.generation import teacher_forced_logits
from larql.inference.layer import embed, final_logits, token_tensor
from larql.kv import from_name
from larql.models import Model
from larql.models.model import load_model


def teacher_forced(model: Model, spec: str, ids: list[int], prompt_len: int) -> torch.Tensor:
    """Logits of engine `spec` after ids[:prompt_len] and after each later id: [N, V]."""
    engine = from_name(spec).build(model)
    return teacher_forced_logits(engine, model, DenseFfn(model), ids, prompt_len)


def full_forward_logits(model: Model, ids: list[int], window: int | None = None) -> torch.Tensor:
    """Logits of every position from one stateless forward pass: [S, V]."""
    with torch.inference_mode():
        h = embed(model, token_tensor(model, ids))
        return final_logits(model, run_layers(model, DenseFfn(model), h, window=window))


def relative_error(a: torch.Tensor, reference: torch.Tensor) -> float:
    return ((a - reference).abs().max() / reference.abs().max()).item()


def kernel_module(name: str) -> ModuleType:
    """`larql.kernels.<name>`: compiled on a CUDA machine, in Triton's interpreter on a CPU one
    (tests/conftest.py turns it on before anything imports Triton); skips without Triton."""
    pytest.importorskip("triton")
    assert torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    return importlib.import_module(f"larql.kernels.{name}")


def model_for_kernels(cpu_model: Model, monkeypatch: pytest.MonkeyPatch) -> Model:
    """The default model (float32) where engines will use the Triton kernels: on CUDA; on a
    CPU machine the CPU model, with the kernels let run there (in the interpreter)."""
    if torch.cuda.is_available():
        return load_model("smollm2-135m", dtype=torch.float32, device="cuda")
    monkeypatch.setattr(larql.kernels, "triton_available", lambda device: True)
    return cpu_model
