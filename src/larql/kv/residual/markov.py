"""`markov-rs`: the residual stream as the decode state.

Each layer keeps its pre-layer residuals — the last `window` rows hot, older rows in a lossless
cold tier — and K/V only as a droppable derivative, extended in O(1) per step. Rows leaving the
hot tier keep the K/V they were computed with, so the engine is exact against `standard` at any
window: `window` splits storage, never attention.
"""

from __future__ import annotations

from larql.kv.residual.codecs import IdentityCodec
from larql.kv.residual.engine import ResidualStreamEngine
from larql.models.model import Model


class MarkovResidualEngine(ResidualStreamEngine):
    name = "markov-rs"

    def codec_labels(self, model: Model) -> list[str]:
        return [IdentityCodec.label] * model.config.num_layers

    def describe(self) -> str:
        return "residual-stream KV replacement — K/V recomputed from stored residuals"
