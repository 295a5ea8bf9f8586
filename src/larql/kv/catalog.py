"""The engine catalog: every engine larql can build, its names, parameters, what it keeps and
its correctness contract. `larql engines`, the README table and the spec parser all read this."""

from __future__ import annotations

from larql.kv.no_cache import NoCacheEngine
from larql.kv.spec import EngineCatalog, EngineEntry, EngineKind, Param, at_least
from larql.kv.standard import StandardEngine

WINDOW_DOC = "keys each query sees, itself included (none = unbounded)"

CATALOG = EngineCatalog()

CATALOG.register(
    EngineEntry(
        name="standard",
        aliases=("full", "fp32", "markov-bounded", "bounded", "sliding"),
        params=(Param("window", int, None, WINDOW_DOC, at_least(1)),),
        keeps="K/V of every layer (the last window−1 rows when windowed), model dtype",
        contract="the reference; window=N is sliding-window attention over N keys",
        factory=lambda p, model: StandardEngine(window=p["window"]),
    )
)
CATALOG.register(
    EngineEntry(
        name="no-cache",
        aliases=("no_cache", "none", "off"),
        params=(),
        keeps="token ids only; re-runs the whole forward pass each step (O(N²))",
        contract="exact vs standard (logits ≤1e-9 relative in float64)",
        factory=lambda p, model: NoCacheEngine(),
    )
)


def from_name(spec: str) -> EngineKind:
    return CATALOG.from_name(spec)


def supported_names() -> list[str]:
    return CATALOG.supported_names()


def split_specs(specs: str) -> list[str]:
    return CATALOG.split_specs(specs)
