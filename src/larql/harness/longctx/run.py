"""Scoring the long-context tasks through an engine, compress-then-ask.

The context goes through the engine's prefill (where a compressing engine quantises or evicts
what it keeps); the question's tokens are then fed as decode steps, and the gold answer is
teacher-forced after them. One pass gives both scores: `score` is 1 when the engine's argmax
at every answer position is the gold token — exactly when greedy decoding would write the
answer — and `answer_logprob` is the gold answer's total log-probability (a graded signal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from larql.harness.longctx.tasks import Sample
from larql.inference.engine import RetrievalEngine
from larql.inference.errors import EngineError
from larql.inference.ffn import FfnBackend, build_ffn
from larql.inference.generation import logits_of, teacher_forced_hidden
from larql.inference.memory import over_ranks
from larql.kv.apollo.store import ApolloStoreError
from larql.kv.catalog import parse_engine
from larql.kv.spec import EngineSpec
from larql.models.model import Model

SCHEMA = "larql.longctx/2"


@dataclass(frozen=True)
class Cell:
    engine: str
    task: str
    length: int
    depth_percent: int  # where the needle sits, in percent of the context
    score: float  # 1.0: greedy decoding writes the gold answer; else 0.0
    answer_logprob: float  # ln p(gold answer | context, question), summed over its tokens
    memory_bytes: int  # the engine's state after the answer
    context_tokens: int
    predicted: str  # the argmax tokens at the answer positions, decoded
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The cell's JSON record; `depth` repeats `depth_percent` for the scripts that read
        the first schema's name."""
        return {**vars(self), "depth": self.depth_percent}


def score_sample(model: Model, ffn: FfnBackend, spec: EngineSpec, sample: Sample) -> Cell:
    """A retrieval engine compresses the context into its store (`index_context`) and gets the
    question as its prompt; every other engine prefills the context and decodes the question."""
    tokenizer = model.tokenizer
    context = tokenizer.encode(sample.context)
    question = tokenizer.encode(sample.question, add_special_tokens=False)
    answer = tokenizer.encode(sample.answer, add_special_tokens=False)
    label = spec.spec()
    try:
        engine = spec.build(model)
        if isinstance(engine, RetrievalEngine):
            engine.index_context(model, sample.context)
            prompt, prefilled = tokenizer.encode(sample.question), None
        else:
            prompt, prefilled = context + question, len(context)
        ids = prompt + answer
        hidden = teacher_forced_hidden(engine, model, ffn, ids[:-1], prefilled or len(prompt))
        logits = list(logits_of(model, hidden))[-len(answer) :]  # the answer positions
    except (EngineError, ApolloStoreError) as e:
        return Cell(
            label,
            sample.task,
            sample.length,
            sample.depth,
            0.0,
            float("nan"),
            0,
            len(context),
            "",
            error=f"{type(e).__name__}: {e}",
        )
    log_probs = [torch.log_softmax(row.double(), dim=-1) for row in logits]
    picked = [int(row.argmax()) for row in log_probs]
    return Cell(
        engine=label,
        task=sample.task,
        length=sample.length,
        depth_percent=sample.depth,
        score=float(picked == answer),
        answer_logprob=sum(float(row[token]) for row, token in zip(log_probs, answer, strict=True)),
        memory_bytes=over_ranks(model, engine.memory().state)[0],
        context_tokens=len(context),
        predicted=tokenizer.decode(picked),
    )


def score_job(model: Model, job: tuple[str, Sample]) -> Cell:
    """One cell of the grid from an engine spec's text and a sample: what one process runs for
    every cell in turn and a worker (`harness.workers`) for its share."""
    spec, sample = job
    return score_sample(model, build_ffn(model, "dense"), parse_engine(spec), sample)
