"""The eviction engines' catalog entries. Every one takes the shared selection's parameters
(`selection_params`: keep= or budget=, sinks, recent, heads) besides its scorer's own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from larql.kv.eviction.budget import HEADS_MODES, LAYERS_MODES, SPREAD, Budget
from larql.kv.eviction.expected_attention import ExpectedAttentionEngine
from larql.kv.eviction.h2o import H2oEngine
from larql.kv.eviction.keydiff import KeyDiffEngine
from larql.kv.eviction.kvzip import KvZipEngine
from larql.kv.eviction.snapkv import SnapKvEngine
from larql.kv.eviction.tova import TovaEngine
from larql.kv.spec import TOKENS, EngineEntry, MalformedEngineSpec, Sweeps
from larql.specs import Param, at_least, one_of

DEFAULT_KEEP = 0.5  # of the prompt rows, where a scorer is given neither keep nor budget


def _fraction(value: float) -> str | None:
    return None if 0 < value <= 1 else "must be in (0, 1] (a fraction of the prompt rows)"


KEEP = Param(
    "keep",
    float,
    None,
    "fraction (0, 1] of the prompt rows each layer keeps, sinks and recent counted in "
    "(instead of budget)",
    _fraction,
    none_word="none",
)
HEADS = Param(
    "heads",
    str,
    "uniform",
    "how a layer's budget is split over its K/V heads: uniform (each the same count) or "
    "adaptive (one budget for the layer, rows picked across heads by per-head normalised "
    "score; each head holds its own count)",
    one_of(*HEADS_MODES),
    lower=True,
)
LAYERS = Param(
    "layers",
    str,
    "uniform",
    "how the budget is split over the layers: uniform (each the same), pyramid (the lower "
    f"layers more, the upper less, on a line from {1 + SPREAD:g}× to {1 - SPREAD:g}×; the same "
    "bytes) or adaptive (kvzip: one budget for the model, rows picked across every layer and "
    "head by score, each head its own count)",
    one_of(*LAYERS_MODES),
    lower=True,
)


def selection_params(sinks: int, recent: int) -> tuple[Param, ...]:
    """keep, budget, sinks, recent, heads of a new scorer (budget: rows per layer and K/V head,
    sinks and recent counted in; neither keep nor budget: keep=0.5)."""
    return (
        KEEP,
        Param(
            "budget",
            int,
            None,
            "rows kept per layer and K/V head, sinks and recent counted in (instead of keep)",
            at_least(1),
            none_word="none",
            bound=TOKENS,
        ),
        Param(
            "sinks", int, sinks, "the prompt's first rows, always kept", at_least(0), bound=TOKENS
        ),
        Param(
            "recent", int, recent, "the prompt's last rows, always kept", at_least(0), bound=TOKENS
        ),
        HEADS,
        LAYERS,
    )


def _check_layers(name: str, p: Mapping[str, Any]) -> None:
    if p["layers"] == "adaptive" and name != "kvzip":
        raise MalformedEngineSpec(
            f"{name}: layers=adaptive picks rows across every layer at once, which needs every "
            "layer's scores before any is cut (kvzip's); use layers=uniform or layers=pyramid"
        )


def budget_of(name: str, p: Mapping[str, Any]) -> Budget:
    """A new scorer's selection from its parameters: keep or budget, not both."""
    if p["keep"] is not None and p["budget"] is not None:
        raise MalformedEngineSpec(f"{name}: give keep or budget, not both")
    _check_layers(name, p)
    keep = DEFAULT_KEEP if p["keep"] is None and p["budget"] is None else p["keep"]
    return Budget(keep, p["budget"], p["sinks"], p["recent"], p["heads"], p["layers"])


def _replaced_budget(name: str, p: Mapping[str, Any], default: int) -> None:
    """snapkv and h2o: keep, when given, replaces their row budget (left at its default)."""
    if p["keep"] is not None and p["budget"] != default:
        raise MalformedEngineSpec(f"{name}: give keep or budget, not both")


def _snapkv(p: Mapping[str, Any]) -> SnapKvEngine:
    if p["kernel"] % 2 == 0:
        raise MalformedEngineSpec(
            f"snapkv: kernel must be odd (centred pooling), got {p['kernel']}"
        )
    _replaced_budget("snapkv", p, 1024)
    _check_layers("snapkv", p)
    return SnapKvEngine(
        p["budget"],
        p["window"],
        p["kernel"],
        profiling=p["profiling"],
        keep=p["keep"],
        sinks=p["sinks"],
        heads=p["heads"],
        layers=p["layers"],
    )


def _h2o(p: Mapping[str, Any]) -> H2oEngine:
    if p["recent"] >= p["budget"]:
        raise MalformedEngineSpec(
            f"h2o: recent must be < budget (the rest are heavy hitters), got "
            f"budget={p['budget']}, recent={p['recent']}"
        )
    _replaced_budget("h2o", p, 512)
    _check_layers("h2o", p)
    return H2oEngine(
        p["budget"],
        p["recent"],
        profiling=p["profiling"],
        keep=p["keep"],
        sinks=p["sinks"],
        heads=p["heads"],
        layers=p["layers"],
    )


SNAPKV = EngineEntry(
    name="snapkv",
    purpose="evicts prompt rows attention skips",
    aliases=(),
    params=(
        Param(
            "budget",
            int,
            1024,
            "prompt rows kept per layer and K/V head besides the window",
            at_least(1),
            bound=TOKENS,
        ),
        Param(
            "window",
            int,
            32,
            "the newest prompt rows: kept, and their queries vote",
            at_least(1),
            bound=TOKENS,
        ),
        Param(
            "kernel", int, 7, "max-pooling width over the votes (odd)", at_least(1), bound=TOKENS
        ),
        KEEP,
        Param("sinks", int, 0, "the prompt's first rows, always kept", at_least(0), bound=TOKENS),
        HEADS,
        LAYERS,
    ),
    keeps="per layer and K/V head: budget voted prompt rows + the window (or keep of the prompt "
    "rows, the window counted in) + every decoded row, model dtype (heads=adaptive: each head "
    "its own count, packed; a layer's own sliding window: that window)",
    contract="exact while the prompt fits budget + window; else bounded KL vs standard "
    "(destructive: prompt rows evicted once, after the prefill; SmolLM2, 1,024-token prompt, "
    "budget 256: mean KL 0.030); query-aware when the question ends the prompt (the window votes)",
    factory=lambda p, model: _snapkv(p),
    sweeps=Sweeps(bench=("budget=64",), accuracy=("budget=64",), longctx=("budget=512",)),
)

H2O = EngineEntry(
    name="h2o",
    purpose="keeps recent rows + heavy hitters",
    aliases=("heavy-hitter",),
    params=(
        Param("budget", int, 512, "rows kept per layer and K/V head", at_least(1), bound=TOKENS),
        Param(
            "recent",
            int,
            256,
            "of them, the newest (the rest: heaviest by attention)",
            at_least(0),
            bound=TOKENS,
        ),
        KEEP,
        Param("sinks", int, 0, "the prompt's first rows, always kept", at_least(0), bound=TOKENS),
        HEADS,
        LAYERS,
    ),
    keeps="per layer and K/V head at most budget rows (or keep of the positions seen: recent "
    "newest + heavy hitters) and their accumulated attention (float32), model dtype "
    "(heads=adaptive: each head its own count, packed; a layer's own sliding window: that window)",
    contract="exact while prompt + decoded rows fit the budget; else bounded KL vs standard "
    "(destructive: evicts as decode proceeds; SmolLM2, budget 256, recent 128: mean KL 0.17)",
    factory=lambda p, model: _h2o(p),
    sweeps=Sweeps(
        bench=("budget=64,recent=32",),
        accuracy=("budget=64,recent=32",),
        longctx=("budget=512,recent=256",),
    ),
)

_KEEPS = (
    "per layer and K/V head: keep of the prompt rows (or budget rows; sinks and recent "
    "counted in) + every decoded row, model dtype (heads=adaptive: each head its own count, "
    "packed; a layer's own sliding window: that window)"
)
_LOSSY = "exact while the prompt fits the budget (keep=1); else bounded KL vs standard "


def _zero_or_at_least_two(value: int) -> str | None:
    # one query has no covariance; 0 is every query after the sinks
    return None if value == 0 or value >= 2 else "must be 0 (every query) or ≥ 2"


EXPECTED_ATTENTION = EngineEntry(
    name="expected-attention",
    purpose="evicts rows future queries will skip",
    aliases=(),
    params=(
        *selection_params(sinks=4, recent=16),
        Param(
            "queries",
            int,
            0,
            "the prompt queries whose mean and covariance model the future ones: 0, every one "
            "after the sinks; N, the last N of them",
            _zero_or_at_least_two,
            bound=TOKENS,
        ),
        Param(
            "future",
            int,
            512,
            "coming positions the rotary embedding is averaged over",
            at_least(1),
            bound=TOKENS,
        ),
        Param("vnorm", int, 1, "weight each row by its value's norm (1) or not (0)", one_of(0, 1)),
    ),
    keeps=_KEEPS,
    contract=_LOSSY + "(destructive: prompt rows evicted once, at the prompt's end, before any "
    "question is seen; query-aware when the question ends the prompt and `queries` is about its "
    "length)",
    factory=lambda p, model: ExpectedAttentionEngine(
        budget_of("expected-attention", p),
        p["queries"],
        p["future"],
        bool(p["vnorm"]),
        profiling=p["profiling"],
    ),
)

KVZIP = EngineEntry(
    name="kvzip",
    purpose="evicts what re-reading the context skips",
    aliases=(),
    params=selection_params(sinks=4, recent=16),
    keeps=_KEEPS,
    contract=_LOSSY + "(destructive: prompt rows evicted once, at the prompt's end, "
    "query-agnostic); the prefill costs ~3× `standard`'s: a second pass, over twice the keys, "
    "reconstructs the context from the cache to score its rows",
    factory=lambda p, model: KvZipEngine(budget_of("kvzip", p), profiling=p["profiling"]),
)

KEYDIFF = EngineEntry(
    name="keydiff",
    purpose="evicts keys that look like the rest",
    aliases=(),
    params=selection_params(sinks=4, recent=16),
    keeps=_KEEPS,
    contract=_LOSSY + "(destructive: prompt rows evicted once, at the prompt's end; reads no "
    "query, so query-agnostic whatever the prompt holds)",
    factory=lambda p, model: KeyDiffEngine(budget_of("keydiff", p), profiling=p["profiling"]),
)

TOVA = EngineEntry(
    name="tova",
    purpose="evicts the rows the newest query skips",
    aliases=(),
    params=selection_params(sinks=4, recent=8),
    keeps="per layer and K/V head: keep of the positions seen (or budget rows; sinks and "
    "recent counted in) and each row's current attention (float32), model dtype "
    "(heads=adaptive: each head its own count, packed; a layer's own sliding window: that "
    "window)",
    contract="exact while prompt + decoded rows fit the budget (keep=1); else bounded KL vs "
    "standard (destructive: evicts at the prompt's end and as decode proceeds, by the newest "
    "query's attention; query-aware when the question ends the prompt)",
    factory=lambda p, model: TovaEngine(budget_of("tova", p), profiling=p["profiling"]),
)
