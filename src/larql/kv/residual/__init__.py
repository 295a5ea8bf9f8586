"""The residual-stream engines: markov-rs, markov-rs-codec and boundary-per-layer — one store,
one decode walk, configured by the hot window and each layer's cold codec."""

from larql.kv.residual.codec_engine import MarkovResidualCodecEngine
from larql.kv.residual.engine import ResidualStreamEngine, check_preconditions
from larql.kv.residual.markov import MarkovResidualEngine
from larql.kv.residual.per_layer import BoundaryPerLayerEngine

__all__ = [
    "BoundaryPerLayerEngine",
    "MarkovResidualCodecEngine",
    "MarkovResidualEngine",
    "ResidualStreamEngine",
    "check_preconditions",
]
