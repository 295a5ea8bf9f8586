"""`turbo-quant`: K/V stored as norm + signed Walsh–Hadamard rotation + Lloyd–Max codes."""

from larql.kv.turbo_quant.codec import RowCodec, TurboQuantCodec
from larql.kv.turbo_quant.engine import TurboQuantEngine
from larql.kv.turbo_quant.entry import ENTRY

__all__ = ["ENTRY", "RowCodec", "TurboQuantCodec", "TurboQuantEngine"]
