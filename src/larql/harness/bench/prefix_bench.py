"""`larql bench --shared-prefix N`: what the prefix cache saves. Each round takes a document of N
tokens and two questions about it: the first question's prompt goes through a fresh engine (a
miss: the whole prompt computed), the second starts from the cache's state of the shared part
(a hit: only its own tokens). Time to first token is the prefill and the first pick, as `larql
serve` measures it; the cache's copy of the state (after the first token) is timed apart.
Engines take their rounds in turn, each round with a new document."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from larql.harness.bench.machine import sync
from larql.inference.errors import EngineError
from larql.inference.ffn import FfnBackend
from larql.inference.generation import GenerationSession
from larql.inference.prefix_cache import PrefixCache, prefill_leaving_states
from larql.kv.spec import EngineSpec
from larql.models.model import Model

QUESTION_TOKENS = 16  # each question's own tokens after the shared document
ROUND_STRIDE = 97  # tokens between two rounds' documents in the text


@dataclass
class PrefixRow:
    spec: str
    shared_tokens: int
    question_tokens: int
    cold_ms: float | None = None  # a prompt the cache has not seen: median time to first token
    warm_ms: float | None = None  # the second question, from the cached document
    store_ms: float | None = None  # copying the state into the cache
    cached_tokens: int | None = None  # prompt tokens the second question took from the cache
    cache_bytes: int | None = None  # the cached state's bytes
    error: str | None = None

    @property
    def speedup(self) -> float | None:
        if not self.cold_ms or not self.warm_ms:
            return None
        return self.cold_ms / self.warm_ms

    def as_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup}


def prefix_prompts(ids: list[int], shared: int, rounds: int) -> list[tuple[list[int], list[int]]]:
    """`rounds` (first, second) prompt pairs cut from `ids`: a document of `shared` tokens, then
    a question of `QUESTION_TOKENS` each (taken from elsewhere in the text), a new document per
    round."""
    span = shared + 2 * QUESTION_TOKENS
    if len(ids) < span + rounds:
        raise ValueError(f"{len(ids)} tokens of text; {span + rounds} needed")
    pairs = []
    for r in range(rounds):
        start = r * (len(ids) - span) // max(rounds, 1)
        document = ids[start : start + shared]
        tail = ids[start + shared : start + span]
        pairs.append((document + tail[:QUESTION_TOKENS], document + tail[QUESTION_TOKENS:]))
    return pairs


def _first_token_ms(
    model: Model, ffn: FfnBackend, kind: EngineSpec, cache: PrefixCache, prompt: list[int]
) -> tuple[float, float, int]:
    """→ (ms to the first token, ms to store the state in the cache, tokens from the cache)."""
    key = kind.spec()
    sync(model.device)
    t0 = time.perf_counter()
    resumed = cache.lookup(model, key, prompt)
    engine = resumed.engine if resumed is not None else kind.build(model)
    held = resumed.tokens if resumed is not None else 0
    generation = GenerationSession(
        engine, model, ffn, prompt[held:], 1, stop_ids=frozenset(), resumes=held > 0
    )
    prefill_leaving_states(generation, cache, model, key, prompt)  # (states along it, for some)
    sync(model.device)
    t1 = time.perf_counter()
    cache.store(model, key, prompt, engine, held)
    sync(model.device)
    return (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000, held


def bench_prefix(
    model: Model,
    ffn: FfnBackend,
    kinds: list[EngineSpec],
    ids: list[int],
    shared: int,
    repeats: int,
) -> list[PrefixRow]:
    """One row per engine: cold and warm time to first token over `repeats` rounds (plus one
    untimed), engines in turn."""
    pairs = prefix_prompts(ids, shared, repeats + 1)
    rows = {kind.spec(): PrefixRow(kind.spec(), shared, QUESTION_TOKENS) for kind in kinds}
    samples: dict[str, list[tuple[float, float, float, int]]] = {key: [] for key in rows}
    with torch.inference_mode():
        for round_, (first, second) in enumerate(pairs):
            for kind in kinds:
                row = rows[kind.spec()]
                if row.error is not None:
                    continue
                cache = PrefixCache(2**62, min_tokens=1)
                try:
                    cold, store, _ = _first_token_ms(model, ffn, kind, cache, first)
                    warm, _, held = _first_token_ms(model, ffn, kind, cache, second)
                except EngineError as e:
                    row.error = str(e)
                    continue
                if round_ == 0:
                    continue  # untimed: the first round pays one-time costs
                samples[row.spec].append((cold, warm, store, held))
                row.cache_bytes = cache.stats().bytes
    for key, row in rows.items():
        if row.error is None and samples[key]:
            row.cold_ms = statistics.median(s[0] for s in samples[key])
            row.warm_ms = statistics.median(s[1] for s in samples[key])
            row.store_ms = statistics.median(s[2] for s in samples[key])
            row.cached_tokens = min(s[3] for s in samples[key])
    return list(rows.values())
