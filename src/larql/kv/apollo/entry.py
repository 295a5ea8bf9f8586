"""`apollo`'s catalog entry."""

from __future__ import annotations

import math

from larql.kv.apollo.engine import build_apollo
from larql.kv.spec import LAYER_INDEX, TOKEN_ID, TOKENS, EngineEntry, Sweeps
from larql.specs import Param, at_least

ENTRY = EngineEntry(
    name="apollo",
    purpose="retrieval from a prebuilt store",
    aliases=(),
    params=(
        Param(
            "layer",
            int,
            None,
            "injection layer (none = the store's)",
            at_least(0),
            bound=LAYER_INDEX,
        ),
        Param(
            "coef",
            float,
            10.0,
            "scale of the injected fact-token embeddings",
            lambda v: None if math.isfinite(v) else "must be finite",
        ),
        Param(
            "top_k", int, 8, "entries retrieved from the routed window", at_least(1), bound=TOKENS
        ),
        Param("store", str, None, "store directory from `larql apollo build-store`", kind="path"),
        Param(
            "bos",
            int,
            None,
            "the id dropped from a query's front (none = the model's BOS)",
            at_least(0),
            bound=TOKEN_ID,
        ),
    ),
    keeps="a prebuilt store (window tokens, boundary residuals, fact entries) and the "
    "context token ids; no K/V — every step re-runs the forward pass (O(N²))",
    contract="task-level retrieval only, never exact; bench and accuracy only (no live "
    "decode); without store= prefill is a RetrievalMiss (the long-context suite builds one "
    "from each context)",
    factory=lambda p, model: build_apollo(
        p["layer"], p["coef"], p["top_k"], p["store"], model, p["bos"]
    ),
    kind="retrieval",
    live_decode=False,
    # it serves from a store a sweep does not have (the long-context suite builds one per
    # context when it is named)
    sweeps=Sweeps(bench=(), accuracy=(), longctx=()),
    quadratic=True,
    refuses_ffn={"remote experts": "replays stored windows through its own forward passes"},
)
