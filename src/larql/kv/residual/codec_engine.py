"""`markov-rs-codec`: markov-rs with the cold tier stored as bfloat16.

Evicted residuals are rounded to bf16 (round-to-nearest-even) and the K/V of each evicted row is
recomputed from the round-tripped residual at its true position, so every later query sees the
codec's rows — the state is exactly what a restore from the stored bytes would give. Until a row
overflows the window nothing is rounded and the engine is bit-identical to markov-rs. In a
bfloat16 model the codec loses nothing: rows are stored bit for bit, no K/V is recomputed, and
the engine is bit-identical to markov-rs at the same window.
"""

from __future__ import annotations

from larql.kv.residual.codecs import Bf16Codec
from larql.kv.residual.engine import ResidualStreamEngine
from larql.models.model import Model


class MarkovResidualCodecEngine(ResidualStreamEngine):
    name = "markov-rs-codec"

    def codec_labels(self, model: Model) -> list[str]:
        return [Bf16Codec.label] * model.config.num_layers

    def describe(self) -> str:
        return "residual-stream KV replacement with bf16 cold codec"

    def config(self) -> str:
        return f"{super().config()},codec={Bf16Codec.label}"
