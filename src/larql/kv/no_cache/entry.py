"""`no-cache`'s catalog entry."""

from __future__ import annotations

from larql.kv.no_cache.engine import NoCacheEngine
from larql.kv.spec import EngineEntry, Sweeps

ENTRY = EngineEntry(
    name="no-cache",
    purpose="no K/V: re-runs the whole context",
    aliases=("no_cache", "none", "off"),
    params=(),
    keeps="token ids only; re-runs the whole forward pass each step (O(N²))",
    contract="exact vs standard (logits ≤1e-9 relative in float64)",
    factory=lambda p, model: NoCacheEngine(),
    sweeps=Sweeps(longctx=()),  # exact: scores as standard does, at O(N²) a step
    quadratic=True,
    refuses_ffn={
        "remote experts": "recomputes the whole history every step, sending every earlier "
        "row's experts over the network again"
    },
)
