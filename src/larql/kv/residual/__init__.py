"""The residual-stream engines: markov-rs, markov-rs-codec and boundary-per-layer — one store,
one decode walk, configured by the hot window and each layer's cold codec."""

from larql.kv.residual.codec_engine import MarkovResidualCodecEngine
from larql.kv.residual.engine import ResidualStreamEngine, check_preconditions
from larql.kv.residual.entry import BOUNDARY_PER_LAYER, MARKOV_RS, MARKOV_RS_CODEC
from larql.kv.residual.markov import MarkovResidualEngine
from larql.kv.residual.per_layer import BoundaryPerLayerEngine

__all__ = [
    "BOUNDARY_PER_LAYER",
    "MARKOV_RS",
    "MARKOV_RS_CODEC",
    "BoundaryPerLayerEngine",
    "MarkovResidualCodecEngine",
    "MarkovResidualEngine",
    "ResidualStreamEngine",
    "check_preconditions",
]
