"""What each engine would hold for a model and a length, without running the model: `larql
memory`. The engines' own code runs — `GenerationSession`'s prefill and decode steps, as `larql
run` drives them — over the model's structure on torch's meta device
(`larql.models.structure`), where every tensor has its shape and dtype and no data; each
engine's `memory()` then counts its tensors as it counts a real run's (`numel × element_size`),
state by tier and growth reserve. An engine's bytes depend on positions, never on values, so
the count is the run's (tests/test_memory_prediction.py holds the two equal); an engine whose
code reads a value on the way cannot run on meta, and its row says so instead of guessing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from larql.errors import InvalidInput, LarqlError
from larql.inference.ffn import build_ffn
from larql.inference.generation import GenerationSession
from larql.inference.memory import MemoryBreakdown
from larql.inference.prompt import check_context
from larql.inference.sampling import Sampler
from larql.kv.catalog import CATALOG
from larql.kv.spec import EngineSpec
from larql.models.model import Model

PROMPT_ID = 0  # every prompt position's token: no engine's bytes depend on which


def default_memory_specs() -> list[str]:
    """Every live engine of the catalog with its defaults, then as the long-context suites run
    it (`Sweeps.longctx`: sized for thousands of tokens), each canonical spec once."""
    specs: list[str] = []
    for entry in CATALOG.entries:
        if entry.live_decode:
            specs += [entry.name, *entry.sweeps.specs(entry.name, "longctx")]
    canonical = (CATALOG.parse(spec).spec() for spec in specs)
    return list(dict.fromkeys(canonical))


@dataclass(frozen=True)
class MemoryPrediction:
    """One engine's bytes after a run of `prompt_tokens` and `max_tokens` new tokens: it holds
    `positions` positions (the last new token is never fed back). `fp16_full_bytes`: a full fp16
    K/V cache of those positions (the `× fp16 full` of `larql bench`)."""

    spec: str
    positions: int
    memory: MemoryBreakdown | None
    fp16_full_bytes: int
    error: str | None = None

    @property
    def ratio_vs_fp16_full(self) -> float | None:
        """State (reserve left out) over the full fp16 cache."""
        if self.memory is None or not self.fp16_full_bytes:
            return None
        return self.memory.state / self.fp16_full_bytes

    def as_json(self) -> dict[str, Any]:
        """`memory` as `larql run --output json` reports it (`MemoryBreakdown.as_json`)."""
        return {
            "engine": self.spec,
            "positions": self.positions,
            "memory": None if self.memory is None else self.memory.as_json(),
            "fp16_full_bytes": self.fp16_full_bytes,
            "ratio_vs_fp16_full": self.ratio_vs_fp16_full,
            "error": self.error,
        }


class _SamePick(Sampler):
    """Picks one id whatever the logits (meta logits have no values to pick from)."""

    def pick(self, logits: torch.Tensor) -> int:
        return PROMPT_ID


def predict_memory(
    structure: Model, specs: Sequence[EngineSpec], prompt_tokens: int, max_tokens: int = 1
) -> list[MemoryPrediction]:
    """Each engine's bytes after a run over `structure` (`load_structure`) of a prompt of
    `prompt_tokens` tokens and `max_tokens` new ones, as `larql run -n max_tokens` reports them
    (`memory`), end-of-turn tokens aside. `structure` may also be a loaded model: the same code
    then computes values too, and takes as long as a run."""
    if prompt_tokens < 1 or max_tokens < 1:
        raise InvalidInput(f"tokens must be ≥ 1, got {prompt_tokens} and {max_tokens} new")
    check_context(structure, prompt_tokens)
    ffn = build_ffn(structure, "dense")
    try:
        return [_predict(structure, ffn, spec, prompt_tokens, max_tokens) for spec in specs]
    finally:
        ffn.close()


def _predict(
    model: Model, ffn: Any, spec: EngineSpec, prompt_tokens: int, max_tokens: int
) -> MemoryPrediction:
    name = spec.spec()
    try:
        spec.require_live_decode()
        engine = spec.build(model)
        session = GenerationSession(
            engine,
            model,
            ffn,
            [PROMPT_ID] * prompt_tokens,
            max_tokens,
            _SamePick(),
            stop_ids=frozenset(),
        )
        session.prefill()
        while not session.finished:
            session.step()
    except LarqlError as e:
        return MemoryPrediction(name, 0, None, 0, str(e))
    except (RuntimeError, NotImplementedError) as e:  # the meta device refuses to read a value
        return MemoryPrediction(name, 0, None, 0, f"its bytes need a real run: {e}")
    held = engine.position
    full = model.config.kv_bytes_per_token(2) * held
    return MemoryPrediction(name, held, engine.memory(), full)
