"""The bench and accuracy harnesses as functions: what `larql bench` and `larql accuracy` (its
prompts suite) run, returning the reports whose `as_dict()` is the JSON those commands write."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from larql.api.engine_specs import EngineLike, engine_spec
from larql.api.renamed import renamed_arguments
from larql.data import read_text
from larql.errors import InvalidInput
from larql.harness.accuracy.run import (
    QUICK_FIDELITY_POSITIONS,
    QUICK_FIDELITY_PROMPT,
    AccuracyReport,
    AccuracySettings,
    run_accuracy,
    run_accuracy_in_workers,
)
from larql.harness.accuracy.run import default_specs as accuracy_specs
from larql.harness.bench.engine_bench import BenchSettings
from larql.harness.bench.prefix_bench import QUESTION_TOKENS
from larql.harness.bench.run import (
    BenchJob,
    BenchReport,
    bench_prompts,
    run_bench,
    run_bench_in_workers,
)
from larql.harness.bench.run import default_specs as bench_specs
from larql.inference.ffn import build_ffn
from larql.inference.ffn.policy import FfnLayerPolicy, split_specs
from larql.kv.catalog import CATALOG
from larql.kv.spec import EngineSpec
from larql.models.model import Model

Engines = str | Sequence[EngineLike]
Progress = Callable[[str], None]


def parse_engines(engines: Engines) -> list[EngineSpec]:
    """An engine list — `"standard;turbo-quant:bits=4"` (`;` or `,` separated, as `--engine`
    takes it) or a sequence of spec strings / `EngineSpec`s — → `EngineSpec`s."""
    items = CATALOG.split_specs(engines) if isinstance(engines, str) else list(engines)
    specs = [engine_spec(e) for e in items]
    if not specs:
        raise InvalidInput(f"the engine list is empty; {CATALOG.supported_message()}")
    return specs


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise InvalidInput(f"{name} must be ≥ {low}, got {value}")


@renamed_arguments(context="prompt_tokens", tokens="max_new_tokens", ffn="ffn_policy")
def bench(
    model: Model,
    engines: Engines | None = None,
    *,
    prompt_tokens: int | None = None,
    depths: Sequence[int] | None = None,
    prompt: str | None = None,
    text_file: str | Path | None = None,
    max_new_tokens: int = 32,
    warmup: int = 3,
    repeats: int = 3,
    profile: bool = False,
    vs_hf: bool = False,
    ffn_policy: str = "dense",
    progress: Progress | None = None,
    batch: Sequence[int] | None = None,
    concurrent: int | None = None,
    shared_prefix: int | None = None,
    workers: int = 1,
) -> BenchReport:
    """`larql bench`: time every engine (whole tokens) at each depth and report its memory;
    `batch` (e.g. [1, 4, 16]) also times that many sessions of each engine decoding at once
    (batched); `concurrent=N`, N sessions of each engine on N threads, each stepping alone;
    `shared_prefix=N`, each engine's time to first token for a second question about a
    document of N tokens, started from the prefix cache, against the first question's.

    One of `prompt_tokens` (a prompt of N tokens cut from `text_file`, default the shipped
    licence text; 128 when none is given), `depths` (several such contexts) or `prompt`
    (text). `max_new_tokens`: the timed decode steps of each repeat, after `warmup` untimed
    ones. `engines` None = the bench's default list. `progress` gets a line per stage.

    `workers=N` spreads the engines over N processes, each loading the model again and timing
    its share: on the CPU each pinned to its own 1/N of the cores with 1/N of the threads, on
    CUDA (a model on `cuda`) worker i on cuda:(i mod the GPUs); the report has one process's
    shape, and `meta["workers"]` says what ran where. Workers that share a CPU or a GPU time
    each other's load too: compare such rows with each other only as a sweep's rough figures."""
    kinds = parse_engines(engines if engines is not None else bench_specs())
    named = (("prompt_tokens", prompt_tokens), ("depths", depths), ("prompt", prompt))
    given = [n for n, v in named if v is not None]
    if len(given) > 1:
        raise InvalidInput(f"give one of prompt_tokens, depths, prompt (got {' and '.join(given)})")
    checked = [("max_new_tokens", max_new_tokens, 1), ("repeats", repeats, 1)]
    checked.append(("warmup", warmup, 0))
    if prompt_tokens is not None:
        checked.append(("prompt_tokens", prompt_tokens, 1))
    for name, value, low in checked:
        _at_least(name, value, low)
    for d in depths or []:
        _at_least("a depth", d, 0)
    for b in batch or []:
        _at_least("a batch size", b, 1)
    if concurrent is not None:
        _at_least("concurrent", concurrent, 1)
    if shared_prefix is not None:
        _at_least("shared_prefix", shared_prefix, 1)
        room = model.config.max_positions - 2 * QUESTION_TOKENS
        if shared_prefix > room:
            raise InvalidInput(
                f"shared_prefix {shared_prefix} and two questions of {QUESTION_TOKENS} tokens "
                f"exceed {model.name}'s context of {model.config.max_positions} (at most {room})"
            )
    FfnLayerPolicy.from_spec(ffn_policy)
    source_text, text_label = read_text(text_file)
    chosen = list(depths) if depths else [prompt_tokens] if prompt_tokens is not None else []
    prompts = bench_prompts(model, source_text, chosen, prompt, warmup + max_new_tokens)
    settings = BenchSettings(
        new_tokens=max_new_tokens, warmup=warmup, repeats=repeats, profile=profile
    )
    prefix = (shared_prefix, source_text) if shared_prefix is not None else None
    batches = list(batch) if batch else None
    _at_least("workers", workers, 1)
    if workers > 1 and len(kinds) > 1:
        job = BenchJob(
            [k.spec() for k in kinds],
            ffn_policy,
            prompts,
            settings,
            vs_hf,
            text_label,
            batches,
            concurrent,
            prefix,
        )
        return run_bench_in_workers(model, job, workers, progress)
    router = build_ffn(model, ffn_policy)
    try:
        return run_bench(
            model,
            router,
            kinds,
            prompts,
            settings,
            vs_hf,
            text_label,
            progress,
            batches,
            concurrent,
            prefix,
        )
    finally:
        router.close()


@renamed_arguments(ffn="ffn_policy")
def accuracy(
    model: Model,
    engines: Engines | None = None,
    *,
    ffn_policy: str | Sequence[str] = "dense",
    quick: bool = False,
    parametric_n: int | None = None,
    needle_max_tokens: int = 8192,
    conflict: bool = True,
    fidelity: bool = True,
    text_file: str | Path | None = None,
    positions: int | None = None,
    prompt_tokens: int | None = None,
    progress: Progress | None = None,
    workers: int = 1,
) -> AccuracyReport:
    """`larql accuracy` (prompts suite): every engine × FFN policy on the three prompt corpora,
    then its teacher-forced fidelity against `standard` over `text_file` (default: the shipped
    licence text). `ffn_policy`: policies as `--ffn-policy` takes them (comma separated) or a
    list;
    `quick`, `parametric_n`, `positions`, `prompt_tokens`, `needle_max_tokens` as the command's
    options (`prompt_tokens` None: 16, or under `quick` a prompt long enough that the
    quantisers' exact recent rows are left behind: `QUICK_FIDELITY_PROMPT`);
    `conflict=False` / `fidelity=False` leave those parts out. `workers=N` spreads the engines
    over N processes (each loads the model again and takes a share of the threads); the report
    is the one one process gives."""
    kinds = parse_engines(engines if engines is not None else accuracy_specs())
    ffn_specs = (split_specs(ffn_policy) if isinstance(ffn_policy, str) else list(ffn_policy)) or [
        "dense"
    ]
    for spec in ffn_specs:
        FfnLayerPolicy.from_spec(spec)
    if positions is not None:
        _at_least("positions", positions, 1)
    if prompt_tokens is None:
        prompt_tokens = QUICK_FIDELITY_PROMPT if quick else 16
    _at_least("prompt_tokens", prompt_tokens, 1)
    if parametric_n is not None:
        _at_least("parametric_n", parametric_n, 1)
    body, label = read_text(text_file)
    settings = AccuracySettings(
        quick=quick,
        parametric_n=parametric_n,
        needle_max_tokens=needle_max_tokens,
        conflict=conflict,
        fidelity=fidelity,
        fidelity_positions=QUICK_FIDELITY_POSITIONS if quick and positions is None else positions,
        **({"quadratic_positions": 64, "greedy_steps": 32} if quick else {}),
        text=body,
        text_label=label,
        fidelity_prompt_tokens=prompt_tokens,
    )
    _at_least("workers", workers, 1)
    if workers > 1:
        return run_accuracy_in_workers(model, kinds, ffn_specs, settings, workers, progress)
    return run_accuracy(model, kinds, ffn_specs, settings, progress)
