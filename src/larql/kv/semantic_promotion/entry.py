"""`semantic-promotion`'s catalog entry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from larql.kv.semantic_promotion.engine import SemanticPromotionEngine
from larql.kv.spec import (
    EngineBuildError,
    EngineEntry,
    EngineSpec,
    MalformedEngineSpec,
    Sweeps,
)
from larql.models.model import Model
from larql.specs import Param, one_of

BASE_DOC = (
    "the engine it wraps, a spec without commas (e.g. standard:window=512); not "
    "semantic-promotion itself"
)
MODE_DOC = "observe: the base runs unchanged (the only mode; enforcing modes are not built)"


def _build(p: Mapping[str, Any], model: Model | None) -> SemanticPromotionEngine:
    base: EngineSpec = p["base"]  # parsed with the spec, under its policy
    if base.entry.name == "semantic-promotion":
        raise MalformedEngineSpec("semantic-promotion: base= must name another engine")
    if not base.entry.live_decode:
        raise EngineBuildError(f"semantic-promotion: base {base.spec()} is not for live decode")
    return SemanticPromotionEngine(base.build(model), base.spec(), p["mode"])


ENTRY = EngineEntry(
    name="semantic-promotion",
    purpose="observes a base engine (identical)",
    aliases=("semantic_promotion", "promotion"),
    params=(
        Param("base", str, "standard", BASE_DOC, kind="spec"),
        Param("mode", str, "observe", MODE_DOC, one_of("observe")),
    ),
    keeps="whatever its base keeps (the base's state, unchanged)",
    contract="bit-identical to its base (observe mode)",
    factory=_build,
    sweeps=Sweeps(longctx=()),  # scores as its base does
)
