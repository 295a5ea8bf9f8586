"""An accuracy run: every (KV engine × FFN backend) strategy over the three corpora, then the
teacher-forced fidelity of every strategy against `standard` with the dense FFN."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from larql.errors import LarqlError
from larql.harness.accuracy.aggregate import StrategySplit, strategy_splits
from larql.harness.accuracy.corpora import (
    CONFLICT,
    PARAMETRIC,
    ConflictPrompt,
    FactPrompt,
    needle_prompts,
)
from larql.harness.accuracy.fidelity import (
    Fidelity,
    greedy_agreement,
    measure_fidelity,
    reference_run,
)
from larql.harness.accuracy.scoring import PromptScore, answer_matches, score_prompt
from larql.harness.workers import in_workers
from larql.inference.errors import EngineError
from larql.inference.ffn import FfnBackend, build_ffn
from larql.inference.generation import generate
from larql.kv.catalog import CATALOG, parse_engine
from larql.kv.spec import EngineSpec
from larql.models.model import Model

SCHEMA = "larql.accuracy/1"

# `--quick` fidelity: 128 teacher-forced positions after a 256-token prompt. The quantisers keep
# their newest rows exact or int8 (turbo-quant's 2- and 3-bit defaults: 128 and 160 rows), so
# behind a 16-token prompt every scored row would still sit in that window and the quick table
# would show the window, not the codes; 256 leaves most rows coded from the first position on.
QUICK_FIDELITY_PROMPT = 256
QUICK_FIDELITY_POSITIONS = 128


def default_specs() -> list[str]:
    """Every engine as its catalog entry says the prompts suite runs it (`Sweeps.accuracy`:
    windowed ones at windows that overflow on the fidelity text)."""
    return CATALOG.default_specs("accuracy")


@dataclass(frozen=True)
class AccuracySettings:
    quick: bool = False
    parametric_n: int | None = None  # the first N parametric prompts (None: all 100)
    needle_max_tokens: int = 8192
    conflict: bool = True
    fidelity: bool = True
    fidelity_prompt_tokens: int = 16
    fidelity_positions: int | None = None  # None = the whole text
    quadratic_positions: int = 256
    greedy_steps: int = 64
    text: str = ""
    text_label: str = ""


@dataclass
class Strategy:
    engine: EngineSpec
    ffn_spec: str

    @property
    def label(self) -> str:
        return self.engine.spec()

    def strategy(self, cross_product: bool) -> str:
        return f"{self.engine.spec()}@{self.ffn_spec}" if cross_product else self.engine.spec()


@dataclass
class AccuracyReport:
    meta: dict[str, Any]
    scores: list[PromptScore] = field(default_factory=list)
    fidelity: list[Fidelity] = field(default_factory=list)

    @property
    def splits(self) -> list[StrategySplit]:
        return strategy_splits(self.scores)

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.meta,
            "splits": [s.as_dict() for s in self.splits],
            "per_prompt": [s.as_dict() for s in self.scores if s.source != "conflict"],
            "per_conflict": [s.as_dict() for s in self.scores if s.source == "conflict"],
            "fidelity": [f.as_dict() for f in self.fidelity],
        }


Corpora = tuple[list[FactPrompt], list[FactPrompt], list[ConflictPrompt]]


def corpora(model: Model, settings: AccuracySettings) -> Corpora:
    parametric = list(PARAMETRIC)
    needles = [
        p
        for _, p in needle_prompts(
            model.tokenizer, settings.needle_max_tokens, model.config.max_positions
        )
    ]
    conflict = list(CONFLICT) if settings.conflict else []
    if settings.quick:
        parametric = parametric[::8][:5]
        needles = needles[:2]
        seen: set[str] = set()
        conflict = [c for c in conflict if not (c.category in seen or seen.add(c.category))][:5]
    if settings.parametric_n is not None:
        parametric = list(PARAMETRIC)[: settings.parametric_n]
    return parametric, needles, conflict


Progress = Callable[[str], None]


def run_accuracy(
    model: Model,
    kinds: list[EngineSpec],
    ffn_specs: list[str],
    settings: AccuracySettings,
    progress: Progress | None = None,
) -> AccuracyReport:
    cross = len(ffn_specs) > 1 or ffn_specs != ["dense"]
    strategies = [Strategy(k, f) for k in kinds for f in ffn_specs]
    parametric, needles, conflicts = corpora(model, settings)
    report = AccuracyReport(
        meta={
            "schema": SCHEMA,
            "model": model.name,
            "dtype": str(model.dtype).removeprefix("torch."),
            "kv_engines": [k.spec() for k in kinds],
            "ffn_backends": ffn_specs,
            "parametric_n": len(parametric),
            "needle_n": len(needles),
            "conflict_n": len(conflicts),
            "fidelity_text": settings.text_label,
        }
    )
    with contextlib.ExitStack() as stack:
        ffns = {spec: build_ffn(model, spec) for spec in ffn_specs}
        for ffn in ffns.values():  # remote FFN clients hold connections until closed
            if hasattr(ffn, "close"):
                stack.callback(ffn.close)
        _score_corpora(
            model, strategies, ffns, cross, (parametric, needles, conflicts), report, progress
        )
        if settings.fidelity:
            report.fidelity = _fidelity(model, strategies, ffns, cross, settings, progress)
            report.meta["fidelity_method"] = (
                f"teacher-forced over {settings.text_label}: prompt of "
                f"{settings.fidelity_prompt_tokens} tokens, then every next token fed as a "
                "decode step; KL(standard‖engine) in nats per position; O(N²) engines capped at "
                f"{settings.quadratic_positions} positions; greedy agreement over "
                f"{settings.greedy_steps} free-running steps"
            )
    return report


def run_accuracy_in_workers(
    model: Model,
    kinds: list[EngineSpec],
    ffn_specs: list[str],
    settings: AccuracySettings,
    workers: int,
    progress: Progress | None = None,
) -> AccuracyReport:
    """`run_accuracy` with the engines spread over `workers` processes (`harness.workers`):
    each runs its share of the engines (every FFN policy of each), and the reports are joined
    in the order one process gives — the same values, each computed as one process would."""
    groups = [kinds[w::workers] for w in range(workers) if kinds[w::workers]]
    jobs = [([k.spec() for k in group], ffn_specs, settings) for group in groups]

    def finished(i: int, _: AccuracyReport) -> None:
        if progress:
            progress(f"worker {i + 1} of {len(jobs)}: {', '.join(jobs[i][0])}")

    parts = in_workers(model, _accuracy_job, jobs, len(jobs), finished)
    cross = len(ffn_specs) > 1 or ffn_specs != ["dense"]
    order = [Strategy(k, f).strategy(cross) for k in kinds for f in ffn_specs]
    scores = {
        label: [s for part in parts for s in part.scores if s.strategy == label] for label in order
    }
    fidelity = {f.spec: f for part in parts for f in part.fidelity}
    report = AccuracyReport(meta={**parts[0].meta, "kv_engines": [k.spec() for k in kinds]})
    report.scores = [score for label in order for score in scores[label]]
    report.fidelity = [fidelity[label] for label in order if label in fidelity]
    return report


def _accuracy_job(
    model: Model, job: tuple[list[str], list[str], AccuracySettings]
) -> AccuracyReport:
    specs, ffn_specs, settings = job
    return run_accuracy(model, [parse_engine(s) for s in specs], ffn_specs, settings)


def _score_corpora(
    model: Model,
    strategies: list[Strategy],
    ffns: dict[str, FfnBackend],
    cross: bool,
    prompts: Corpora,
    report: AccuracyReport,
    progress: Progress | None,
) -> None:
    parametric, needles, conflicts = prompts
    for strategy in strategies:
        ffn = ffns[strategy.ffn_spec]
        labels = (strategy.engine.spec(), strategy.ffn_spec, strategy.strategy(cross))
        if progress:
            progress(f"corpora: {labels[2]}")
        for fact in [*parametric, *needles]:
            score, _ = score_prompt(
                model,
                ffn,
                strategy.engine,
                fact.prompt,
                fact.expected,
                labels,
                fact.category,
                fact.source,
            )
            report.scores.append(score)
        for c in conflicts:
            score, predicted = score_prompt(
                model, ffn, strategy.engine, c.prompt, c.override, labels, c.category, "conflict"
            )
            if predicted is not None:
                followed = answer_matches(predicted, c.override)
                fallback = not followed and answer_matches(predicted, c.parametric)
                score = dataclasses.replace(
                    score, followed_context=followed, parametric_fallback=fallback
                )
            report.scores.append(score)


def _fidelity(
    model: Model,
    strategies: list[Strategy],
    ffns: dict[str, FfnBackend],
    cross: bool,
    settings: AccuracySettings,
    progress: Progress | None,
) -> list[Fidelity]:
    ids = model.tokenizer.encode(settings.text)
    ids = ids[: model.config.max_positions]
    prompt_len = settings.fidelity_prompt_tokens
    if prompt_len >= len(ids) - 1:
        raise LarqlError(
            f"--prompt-tokens {prompt_len} leaves no position to score: the fidelity text has "
            f"{len(ids)} tokens (within the model's context)"
        )
    if settings.fidelity_positions is not None:
        ids = ids[: prompt_len + settings.fidelity_positions]
    dense = ffns.get("dense") or build_ffn(model, "dense")
    standard = parse_engine("standard")
    if progress:
        progress("fidelity: reference (standard)")
    reference = reference_run(model, dense, standard, ids, prompt_len)
    greedy_ref = generate(
        standard.build(model),
        model,
        dense,
        ids[:prompt_len],
        settings.greedy_steps,
        stop_ids=frozenset(),
    ).tokens
    results = []
    for strategy in strategies:
        if progress:
            progress(f"fidelity: {strategy.strategy(cross)}")
        ffn = ffns[strategy.ffn_spec]
        quadratic = strategy.engine.entry.quadratic
        cap = settings.quadratic_positions if quadratic else None
        result = measure_fidelity(model, ffn, strategy.engine, ids, prompt_len, reference, cap)
        result.spec = strategy.strategy(cross)
        if quadratic:
            result.note = f"O(N²) engine: first {result.positions} positions only"
        if result.error is None:
            try:
                result.first_divergence, result.token_match = greedy_agreement(
                    model, ffn, strategy.engine, ids[:prompt_len], greedy_ref
                )
                result.greedy_steps = len(greedy_ref)
            except EngineError as e:
                result.note = f"greedy run failed: {e}"
        results.append(result)
    return results
