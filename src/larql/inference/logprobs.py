"""Log-probabilities of tokens under the model's next-token distributions: of each prompt token
(from a teacher-forced pass: every position sees the true prefix) and of each picked token (from
the raw logits the sampler was given, before temperature, top-k and top-p).

Computed in float64 from the logits as the model produced them, so the sum over a text is its
teacher-forced loss (negated) to float64 rounding."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from larql.inference.engine import Engine
from larql.inference.ffn import FfnBackend
from larql.inference.generation import logits_of, teacher_forced_hidden
from larql.models.model import Model


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # ln P(token | everything before it)
    top: tuple[tuple[int, float], ...]  # the most likely tokens there (id, logprob), best first


def token_logprob(logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    """logits [V] (any float dtype) → the token's log-probability and the `top_n` best."""
    log_p = torch.log_softmax(logits.detach().double().cpu(), dim=-1)  # [V]
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        values, ids = torch.topk(log_p, min(top_n, log_p.shape[-1]))  # [top_n], sorted
        top = tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
    return TokenLogprob(token_id, float(log_p[token_id]), top)


def score_hidden(
    model: Model, hidden_rows: Iterable[torch.Tensor], targets: Sequence[int], top_n: int
) -> list[TokenLogprob]:
    """Hidden rows [1, H] (pre-final-norm, one per position) and the token that follows each →
    each target's log-probability; the LM head runs on batches of rows (`logits_of`)."""
    rows = logits_of(model, hidden_rows)
    return [token_logprob(row, t, top_n) for row, t in zip(rows, targets, strict=True)]


def prompt_logprobs(
    model: Model,
    ffn: FfnBackend,
    rows: torch.Tensor,
    ids: Sequence[int],
    top_n: int,
    fresh_engine: Callable[[], Engine],
) -> list[TokenLogprob]:
    """The log-probability of every prompt token after the first, from the hidden rows [S', H]
    the engine's prefill returned for the prompt `ids` (row i predicts ids[i + 1]).

    An engine whose prefill returns fewer rows than the prompt (it keeps only the last) has the
    prompt teacher-forced through `fresh_engine()` instead: its first token prefilled, every
    later one fed as a decode step (`teacher_forced_hidden`)."""
    if len(ids) < 2:
        return []
    if rows.shape[0] >= len(ids):
        hidden: Iterable[torch.Tensor] = rows[-len(ids) : -1].split(1)  # [1, H] each
    else:
        hidden = teacher_forced_hidden(fresh_engine(), model, ffn, ids[:-1], 1)
    return score_hidden(model, hidden, ids[1:], top_n)
