"""Log-probabilities of tokens under the model's next-token distributions: of each prompt token
(from a teacher-forced pass: every position sees the true prefix) and of each picked token (from
the raw logits the sampler was given, before temperature, top-k and top-p).

Computed in float64 from the logits as the model produced them, so the sum over a text is its
teacher-forced loss (negated) to float64 rounding."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from larql.inference.errors import InvariantViolation
from larql.inference.generation import logits_of
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


class PromptScorer:
    """A prompt's log-probabilities from the hidden rows its prefill returns, as they come (a
    long prompt goes in a part at a time): the row of prompt position i predicts ids[i + 1];
    the last prompt row predicts what follows the prompt and scores nothing."""

    def __init__(self, model: Model, ids: Sequence[int], top_n: int) -> None:
        self.model, self.ids, self.top_n = model, list(ids), top_n
        self.records: list[TokenLogprob] = []

    def add(self, rows: torch.Tensor, start: int, count: int) -> None:
        """rows [count, H]: the hidden rows of prompt positions start..start+count−1 (every
        row of them: an engine that returns fewer cannot have its prompt scored)."""
        if rows.shape[0] != count:
            raise InvariantViolation(
                f"scoring a prompt needs a hidden row per prompt token; the engine returned "
                f"{rows.shape[0]} for {count}"
            )
        scored = min(count, len(self.ids) - 1 - start)  # the prompt's last row scores nothing
        if scored > 0:
            targets = self.ids[start + 1 : start + 1 + scored]
            self.records += score_hidden(self.model, rows[:scored].split(1), targets, self.top_n)
