"""The FFN of each layer: the backend interface and its backends (dense, null, walk, remote
walk), the backend spec grammar, the per-layer policy and its router, the wire format FFN shards
speak, and what `larql walk` inspects."""

from larql.inference.ffn.activation import gated_activation
from larql.inference.ffn.backend import DenseFfn, FfnBackend, NullFfn
from larql.inference.ffn.policy import LayerFfnRouter, build_ffn

__all__ = ["DenseFfn", "FfnBackend", "LayerFfnRouter", "NullFfn", "build_ffn", "gated_activation"]
