"""`no-cache`'s catalog entry."""

from __future__ import annotations

from larql.kv.no_cache.engine import NoCacheEngine
from larql.kv.spec import EngineEntry

ENTRY = EngineEntry(
    name="no-cache",
    aliases=("no_cache", "none", "off"),
    params=(),
    keeps="token ids only; re-runs the whole forward pass each step (O(N²))",
    contract="exact vs standard (logits ≤1e-9 relative in float64)",
    factory=lambda p, model: NoCacheEngine(),
)
