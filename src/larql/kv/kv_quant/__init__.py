"""`kv-quant`: the plain K/V quantisers (int8/int4/int2 per-token groups, fp8 e4m3), the
baseline family turbo-quant is measured against."""

from larql.kv.kv_quant.engine import KvQuantEngine
from larql.kv.kv_quant.entry import ENTRY

__all__ = ["ENTRY", "KvQuantEngine"]
