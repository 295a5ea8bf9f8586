"""Small helpers the test modules share."""

from __future__ import annotations

import torch

from larql.inference.ffn import DenseFfn
from larql.inference.forward import run_layers
from larql.inference.generation import teacher_forced_logits
from larql.inference.layer import embed, final_logits, token_tensor
from larql.kv import from_name
from larql.models import Model


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
