"""Scoring the RULER samples through an engine, compress-then-ask.

The context goes through the engine's prefill, where a compressing engine evicts or codes what
it keeps before any question exists; the bytes it then holds are recorded. Each query is fed
as decode steps on a fork of that state (compress once, ask many: a multi-query sample asks
every query on the same compressed context) and answered greedily; its score is the share of
its gold answers the continuation contains (RULER's string_match_all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from larql.harness.ruler.tasks import Query, Sample, answer_text, query_score
from larql.inference.engine import Engine, RetrievalEngine
from larql.inference.errors import EngineError
from larql.inference.ffn import FfnBackend, build_ffn
from larql.inference.generation import generate
from larql.inference.memory import over_ranks
from larql.inference.snapshots.errors import SnapshotError
from larql.kv.catalog import parse_engine
from larql.kv.spec import EngineSpec
from larql.models.model import Model

SCHEMA = "larql.ruler/1"


@dataclass(frozen=True)
class Cell:
    engine: str
    task: str
    length: int
    index: int
    score: float  # mean over the sample's queries of the share of answers found
    memory_bytes: int  # the engine's state after the context, before any question
    context_tokens: int
    predicted: list[str]  # each query's greedy continuation
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def _answer(
    engine: Engine, model: Model, ffn: FfnBackend, hidden: torch.Tensor, query: Query
) -> tuple[float, str]:
    tokenizer = model.tokenizer
    question = tokenizer.encode(query.question, add_special_tokens=False)
    written: list[int] = []

    def done(token: int) -> bool:  # a closing quote or a new line ends the answer
        written.append(token)
        text = tokenizer.decode(written)
        return "\n" in text or (len(query.answers) == 1 and '"' in text)

    result = generate(
        engine, model, ffn, question, query.max_new_tokens, on_token=done, resume_hidden=hidden
    )
    text = answer_text(query, tokenizer.decode(result.tokens))
    return query_score(query, text), text


def score_sample(model: Model, ffn: FfnBackend, spec: EngineSpec, sample: Sample) -> Cell:
    label = spec.spec()
    context = model.tokenizer.encode(sample.context)
    try:
        engine = spec.build(model)
        if isinstance(engine, RetrievalEngine):
            raise EngineError(f"{label} is a retrieval engine; the ruler suite prefills a cache")
        hidden = engine.prefill(model, ffn, context)
        (held,) = over_ranks(model, engine.memory().state)
        scores, texts = [], []
        for i, query in enumerate(sample.queries):
            asking, start = (
                (engine, hidden)
                if i == len(sample.queries) - 1
                else _fork(engine, hidden, model, ffn, spec, context)
            )
            score, text = _answer(asking, model, ffn, start, query)
            scores.append(score)
            texts.append(text)
    except EngineError as e:
        return Cell(
            label,
            sample.task,
            sample.length,
            sample.index,
            0.0,
            0,
            len(context),
            [],
            error=f"{type(e).__name__}: {e}",
        )
    return Cell(
        label,
        sample.task,
        sample.length,
        sample.index,
        sum(scores) / len(scores),
        held,
        len(context),
        texts,
    )


def _fork(
    engine: Engine,
    hidden: torch.Tensor,
    model: Model,
    ffn: FfnBackend,
    spec: EngineSpec,
    context: list[int],
) -> tuple[Engine, torch.Tensor]:
    """A copy of the compressed state (and the context's last hidden row [1, H]) to ask one
    query on; an engine that cannot fork its state compresses the same context again."""
    try:
        return engine.fork(model), hidden
    except SnapshotError:
        again = spec.build(model)
        return again, again.prefill(model, ffn, context)


def score_job(model: Model, job: tuple[str, Sample]) -> Cell:
    """One cell of the grid from an engine spec's text and a sample: what one process runs for
    every cell in turn and a worker (`harness.workers`) for its share."""
    spec, sample = job
    return score_sample(model, build_ffn(model, "dense"), parse_engine(spec), sample)


def mean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")
