"""The one generation loop every command uses: prefill, pick, then decode step by step through
an engine, streaming each token to a callback."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from larql.inference.engine import AnyEngine, EmptyPrompt
from larql.inference.ffn import FfnBackend
from larql.inference.layer import final_logits
from larql.inference.sampling import Sampler
from larql.models.model import Model

FinishReason = Literal["stop", "length"]
# on_token(token_id) may return True to stop early (a client went away, a stop string matched).
TokenCallback = Callable[[int], bool | None]


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: FinishReason
    prefill_ms: float  # prefill + first pick
    step_ms: list[float] = field(default_factory=list)  # each later token: forward + pick

    @property
    def decode_tok_s(self) -> float | None:
        total = sum(self.step_ms)
        return 1000.0 * len(self.step_ms) / total if total > 0 else None


def next_token_logits(model: Model, hidden: torch.Tensor) -> torch.Tensor:
    """An engine's output hidden [1, H] → next-token logits [V]."""
    return final_logits(model, hidden)[0]


def generate(
    engine: AnyEngine,
    model: Model,
    ffn: FfnBackend,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampler: Sampler | None = None,
    on_token: TokenCallback | None = None,
    stop_ids: frozenset[int] | None = None,
    max_positions: int | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens (a stop token is emitted, then ends the run).

    `max_positions` caps prompt + generated tokens (the model's context by default)."""
    if not prompt_ids:
        raise EmptyPrompt()
    sampler = sampler or Sampler()
    stop_ids = model.tokenizer.stop_ids if stop_ids is None else stop_ids
    limit = model.config.max_positions if max_positions is None else max_positions
    budget = min(max_new_tokens, max(limit - len(prompt_ids), 0))
    result = GenerationResult(tokens=[], finish_reason="length", prefill_ms=0.0)
    if budget <= 0:
        return result
    with torch.inference_mode():
        t0 = time.perf_counter()
        hidden = engine.prefill(model, ffn, prompt_ids)
        token = sampler.pick(next_token_logits(model, hidden))
        result.prefill_ms = (time.perf_counter() - t0) * 1000
        while True:
            result.tokens.append(token)
            stop_requested = on_token(token) if on_token is not None else False
            if token in stop_ids:
                result.finish_reason = "stop"
                break
            if stop_requested:
                result.finish_reason = "stop"
                break
            if len(result.tokens) >= budget:
                break
            t0 = time.perf_counter()
            hidden = engine.decode_step(model, ffn, token)
            token = sampler.pick(next_token_logits(model, hidden))
            result.step_ms.append((time.perf_counter() - t0) * 1000)
    return result


def teacher_forced_logits(
    engine: AnyEngine, model: Model, ffn: FfnBackend, ids: Sequence[int], prompt_len: int
) -> torch.Tensor:
    """Prefill `ids[:prompt_len]`, then feed each later id as a decode step regardless of what
    the model would pick → next-token logits after the prompt and after every fed token,
    [len(ids) − prompt_len + 1, V]."""
    with torch.inference_mode():
        rows = [next_token_logits(model, engine.prefill(model, ffn, ids[:prompt_len]))]
        for token in ids[prompt_len:]:
            rows.append(next_token_logits(model, engine.decode_step(model, ffn, token)))
    return torch.stack(rows)
