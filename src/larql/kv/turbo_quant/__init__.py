"""`turbo-quant`: K/V stored as norm + signed Walsh–Hadamard rotation + Lloyd–Max codes."""

from larql.kv.turbo_quant.codec import RowCodec, TurboQuantCodec
from larql.kv.turbo_quant.engine import TurboQuantEngine

__all__ = ["RowCodec", "TurboQuantCodec", "TurboQuantEngine"]
