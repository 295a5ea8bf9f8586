"""Teacher-forced fidelity against the full cache (llama-perplexity style) and free-running
greedy agreement.

Every engine decodes the same text token by token (teacher forcing); at each position we compare
its next-token distribution Q with the `standard` engine's P: KL(P‖Q), same top-1, the change
in probability of the true next token (Δp), and the perplexity ratio — and beside them the pure
metrics of `metrics`: Jensen–Shannon, top-5 overlap, the reciprocal rank of P's top-1 under Q,
and the cosine and MSE of the engine's hidden row against the reference's."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from larql.harness.accuracy.metrics import (
    cosine_similarity,
    first_divergence,
    js_divergence,
    mse,
    reciprocal_rank,
    token_match_rate,
    top_k_overlap,
)
from larql.harness.bench.stats import nearest_rank
from larql.inference.engine import Engine
from larql.inference.errors import EngineError
from larql.inference.ffn import FfnBackend
from larql.inference.generation import generate, logits_of, teacher_forced_hidden
from larql.inference.memory import over_ranks
from larql.kv.spec import EngineSpec
from larql.models.model import Model


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(P‖Q) in nats per row, from logits [N, V] (float64 log-softmax)."""
    log_p = torch.log_softmax(p_logits.double(), dim=-1)
    log_q = torch.log_softmax(q_logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp_min(0.0)


@dataclass
class ReferenceRun:
    """The reference engine's logits at every scored position, as computed (model dtype, CPU),
    so comparing the reference with itself gives exactly 0."""

    logits: torch.Tensor  # [N, V]
    targets: torch.Tensor  # [N] the true next tokens
    hidden: torch.Tensor | None = None  # [N, H] the pre-final-norm rows those logits came from


@dataclass
class Fidelity:
    spec: str
    positions: int
    mean_kl: float
    median_kl: float
    p99_kl: float
    max_kl: float
    same_top1: float
    delta_p_rms: float
    ln_ppl_ratio: float
    memory_bytes: int  # the engine's state after the text (growth reserve apart)
    reserve_bytes: int
    ratio_vs_fp16: float | None = None  # the state over an fp16 full cache of the same tokens
    first_divergence: int | None = None  # greedy step where tokens first differ (None = never)
    greedy_steps: int = 0
    token_match: float | None = None  # the fraction of greedy steps with the reference's token
    mean_js: float = math.nan  # Jensen–Shannon divergence, nats
    top5_overlap: float = math.nan  # |top-5(P) ∩ top-5(Q)| / 5, mean over positions
    mrr: float = math.nan  # mean reciprocal rank of P's top-1 under Q
    hidden_cosine: float = math.nan  # mean cosine of the hidden rows
    hidden_mse: float = math.nan  # mean squared difference of the hidden rows
    note: str = ""
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in vars(self).items()
        }


def reference_run(
    model: Model, ffn: FfnBackend, reference: EngineSpec, ids: list[int], prompt_len: int
) -> ReferenceRun:
    engine = reference.build(model)
    hidden: list[torch.Tensor] = []
    logits = teacher_forced(model, ffn, engine, ids, prompt_len, hidden)
    rows = [row.cpu() for row in logits]
    return ReferenceRun(torch.stack(rows), torch.tensor(ids[prompt_len:]), torch.cat(hidden))


def teacher_forced(
    model: Model,
    ffn: FfnBackend,
    engine: Engine,
    ids: list[int],
    prompt_len: int,
    hidden: list[torch.Tensor] | None = None,
) -> Iterator[torch.Tensor]:
    """Logits [V] predicting ids[prompt_len], ids[prompt_len + 1], …, ids[-1], in turn; the
    hidden rows [1, H] they come from are appended to `hidden` (on the CPU) where given."""
    rows = teacher_forced_hidden(engine, model, ffn, ids[:-1], prompt_len)
    return logits_of(model, rows if hidden is None else _kept(rows, hidden))


def _kept(rows: Iterator[torch.Tensor], into: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    for row in rows:
        into.append(row.detach().float().cpu())
        yield row


def measure_fidelity(
    model: Model,
    ffn: FfnBackend,
    kind: EngineSpec,
    ids: list[int],
    prompt_len: int,
    reference: ReferenceRun,
    max_positions: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Fidelity:
    n = (
        len(reference.targets)
        if max_positions is None
        else min(max_positions, len(reference.targets))
    )
    kls, top1, dp, nll_q, nll_p = [], [], [], [], []
    js, overlap, rr = [], [], []
    hidden: list[torch.Tensor] = []
    try:
        engine = kind.build(model)
        stream = teacher_forced(model, ffn, engine, ids[: prompt_len + n], prompt_len, hidden)
        for i, logits in enumerate(stream):
            log_q = torch.log_softmax(logits.double().cpu(), dim=-1)
            log_p = torch.log_softmax(reference.logits[i].double(), dim=-1)
            target = int(reference.targets[i])
            kls.append(float(kl_divergence(log_p, log_q)))
            top1.append(int(log_p.argmax()) == int(log_q.argmax()))
            js.append(js_divergence(log_p, log_q))
            overlap.append(top_k_overlap(log_p, log_q, 5))
            rr.append(reciprocal_rank(int(log_p.argmax()), log_q))
            dp.append(float(log_q[target].exp() - log_p[target].exp()))
            nll_q.append(-float(log_q[target]))
            nll_p.append(-float(log_p[target]))
            if progress:
                progress(i)
    except EngineError as e:
        return Fidelity(kind.spec(), 0, *([math.nan] * 7), 0, 0, error=f"{type(e).__name__}: {e}")
    held_tokens = prompt_len + len(kls) - 1  # the last position's token is never fed
    held = engine.memory()
    state, reserved = over_ranks(model, held.state, held.reserved)
    world = model.shard.world if model.shard is not None else 1  # (the config is a rank's)
    cosines, squares = _hidden_agreement(hidden, reference.hidden)
    return Fidelity(
        spec=kind.spec(),
        positions=len(kls),
        mean_kl=sum(kls) / len(kls),
        median_kl=nearest_rank(kls, 50),
        p99_kl=nearest_rank(kls, 99),
        max_kl=max(kls),
        same_top1=sum(top1) / len(top1),
        delta_p_rms=math.sqrt(sum(x * x for x in dp) / len(dp)),
        ln_ppl_ratio=(sum(nll_q) - sum(nll_p)) / len(kls),
        memory_bytes=state,
        reserve_bytes=reserved,
        ratio_vs_fp16=state / (world * model.config.kv_bytes_per_token(2)) / held_tokens
        if state
        else None,
        mean_js=sum(js) / len(js),
        top5_overlap=sum(overlap) / len(overlap),
        mrr=sum(rr) / len(rr),
        hidden_cosine=sum(cosines) / len(cosines) if cosines else math.nan,
        hidden_mse=sum(squares) / len(squares) if squares else math.nan,
    )


def _hidden_agreement(
    hidden: list[torch.Tensor], reference: torch.Tensor | None
) -> tuple[list[float], list[float]]:
    """Cosine and MSE of each scored hidden row against the reference's (none where the
    reference kept no rows)."""
    if reference is None:
        return [], []
    rows = list(zip(hidden, reference, strict=False))
    return [cosine_similarity(a, b) for a, b in rows], [mse(a, b) for a, b in rows]


def greedy_tokens(
    model: Model, ffn: FfnBackend, kind: EngineSpec, prompt_ids: list[int], steps: int
) -> list[int]:
    """The engine's free-running greedy tokens after the prompt."""
    engine = kind.build(model)
    return generate(engine, model, ffn, prompt_ids, steps, stop_ids=frozenset()).tokens


def greedy_divergence(
    model: Model, ffn: FfnBackend, kind: EngineSpec, prompt_ids: list[int], reference: list[int]
) -> int | None:
    """First step at which the engine's free-running greedy tokens leave the reference's."""
    return first_divergence(greedy_tokens(model, ffn, kind, prompt_ids, len(reference)), reference)


def greedy_agreement(
    model: Model, ffn: FfnBackend, kind: EngineSpec, prompt_ids: list[int], reference: list[int]
) -> tuple[int | None, float]:
    """(first divergent greedy step or None, the fraction of steps with the reference's token)."""
    tokens = greedy_tokens(model, ffn, kind, prompt_ids, len(reference))
    return first_divergence(tokens, reference), token_match_rate(tokens, reference)
