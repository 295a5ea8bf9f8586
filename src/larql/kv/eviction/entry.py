"""The eviction engines' catalog entries."""

from __future__ import annotations

from larql.kv.eviction.h2o import H2oEngine
from larql.kv.eviction.snapkv import SnapKvEngine
from larql.kv.spec import TOKENS, EngineEntry, MalformedEngineSpec, Sweeps
from larql.specs import Param, at_least


def _snapkv(p: dict) -> SnapKvEngine:
    if p["kernel"] % 2 == 0:
        raise MalformedEngineSpec(
            f"snapkv: kernel must be odd (centred pooling), got {p['kernel']}"
        )
    return SnapKvEngine(p["budget"], p["window"], p["kernel"], profiling=p["profiling"])


def _h2o(p: dict) -> H2oEngine:
    if p["recent"] >= p["budget"]:
        raise MalformedEngineSpec(
            f"h2o: recent must be < budget (the rest are heavy hitters), got "
            f"budget={p['budget']}, recent={p['recent']}"
        )
    return H2oEngine(p["budget"], p["recent"], profiling=p["profiling"])


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
    ),
    keeps="per layer and K/V head: budget voted prompt rows + the window + every decoded row, "
    "model dtype (a layer's own sliding window: that window)",
    contract="exact while the prompt fits budget + window; else bounded KL vs standard "
    "(destructive: prompt rows evicted once, after the prefill; SmolLM2, 1,024-token prompt, "
    "budget 256: mean KL 0.030)",
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
    ),
    keeps="per layer and K/V head at most budget rows (recent newest + heavy hitters) and their "
    "accumulated attention (float32), model dtype (a layer's own sliding window: that window)",
    contract="exact while prompt + decoded rows fit the budget; else bounded KL vs standard "
    "(destructive: evicts as decode proceeds; SmolLM2, budget 256, recent 128: mean KL 0.17)",
    factory=lambda p, model: _h2o(p),
    sweeps=Sweeps(
        bench=("budget=64,recent=32",),
        accuracy=("budget=64,recent=32",),
        longctx=("budget=512,recent=256",),
    ),
)
