"""Scoring one prompt with a fresh engine (prefill only): the top-1 token, whether it starts the
expected answer, and the Shannon bits of the answer's first token. An `EngineError` becomes a
skipped outcome, 1:1 with its type, so skips are counted, never dropped."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from larql.inference.errors import (
    BackendFailure,
    BackendUnavailable,
    EmptyPrompt,
    EngineError,
    InvariantViolation,
    RetrievalMiss,
)
from larql.inference.ffn import FfnBackend
from larql.inference.generation import next_token_logits
from larql.kv.spec import EngineSpec
from larql.models.model import Model


class Outcome(StrEnum):
    SERVED = "served"
    SKIPPED_EMPTY_PROMPT = "skipped_empty_prompt"
    SKIPPED_RETRIEVAL_MISS = "skipped_retrieval_miss"
    SKIPPED_BACKEND_UNAVAILABLE = "skipped_backend_unavailable"
    SKIPPED_INVARIANT_VIOLATION = "skipped_invariant_violation"
    SKIPPED_BACKEND_FAILURE = "skipped_backend_failure"

    @classmethod
    def from_error(cls, error: EngineError) -> Outcome:
        for kind, outcome in _ERROR_OUTCOMES:
            if isinstance(error, kind):
                return outcome
        return cls.SKIPPED_BACKEND_FAILURE


_ERROR_OUTCOMES = (
    (EmptyPrompt, Outcome.SKIPPED_EMPTY_PROMPT),
    (RetrievalMiss, Outcome.SKIPPED_RETRIEVAL_MISS),
    (BackendUnavailable, Outcome.SKIPPED_BACKEND_UNAVAILABLE),
    (InvariantViolation, Outcome.SKIPPED_INVARIANT_VIOLATION),
    (BackendFailure, Outcome.SKIPPED_BACKEND_FAILURE),
)


@dataclass(frozen=True)
class PromptScore:
    """Score fields are None exactly when the prompt was skipped."""

    prompt: str
    category: str
    source: str  # parametric | in_context | conflict
    kv_engine: str
    ffn_backend: str
    strategy: str
    expected: str
    outcome: Outcome
    predicted: str | None = None
    matched: bool | None = None
    bits: float | None = None
    followed_context: bool | None = None
    parametric_fallback: bool | None = None

    @property
    def served(self) -> bool:
        return self.outcome is Outcome.SERVED

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if k != "prompt"}
        d["prompt"] = self.prompt if len(self.prompt) <= 200 else self.prompt[:200] + "…"
        d["outcome"] = self.outcome.value
        if d["bits"] is not None and not math.isfinite(d["bits"]):
            d["bits"] = str(d["bits"])  # JSON has no inf/nan
        return d


def answer_matches(predicted: str, expected: str) -> bool:
    """The predicted first token starts the expected answer (case-insensitive, spaces trimmed)."""
    piece = predicted.strip().lower()
    return bool(piece) and expected.strip().lower().startswith(piece)


def answer_bits(model: Model, logits: torch.Tensor, expected: str) -> float:
    """−log2 P(first token of " " + expected) (else of expected): how surprised the model is."""
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    for text in (" " + expected, expected):
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        if ids:
            return float(-log_probs[ids[0]] / math.log(2))
    return math.nan


def score_prompt(
    model: Model,
    ffn: FfnBackend,
    kind: EngineSpec,
    prompt: str,
    expected: str,
    labels: tuple[str, str, str],
    category: str,
    source: str,
) -> tuple[PromptScore, str | None]:
    """(score, predicted text). labels = (kv_engine, ffn_backend, strategy)."""
    kv, ffn_name, strategy = labels
    base = dict(
        prompt=prompt,
        category=category,
        source=source,
        kv_engine=kv,
        ffn_backend=ffn_name,
        strategy=strategy,
        expected=expected,
    )
    ids = model.tokenizer.encode(prompt)
    try:
        engine = kind.build(model)
        with torch.inference_mode():
            logits = next_token_logits(model, engine.prefill(model, ffn, ids)).float()
    except EngineError as e:
        return PromptScore(**base, outcome=Outcome.from_error(e)), None
    finite = torch.isfinite(logits)
    if not finite.any():
        return PromptScore(**base, outcome=Outcome.SKIPPED_BACKEND_FAILURE), None
    top1 = int(torch.argmax(torch.where(finite, logits, float("-inf"))))
    predicted = model.tokenizer.decode([top1])
    score = PromptScore(
        **base,
        outcome=Outcome.SERVED,
        predicted=predicted,
        matched=answer_matches(predicted, expected),
        bits=answer_bits(model, logits, expected),
    )
    return score, predicted
