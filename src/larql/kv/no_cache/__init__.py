"""`no-cache`: token ids only, the whole forward pass re-run every step (the oracle)."""

from larql.kv.no_cache.engine import NoCacheEngine
from larql.kv.no_cache.entry import ENTRY

__all__ = ["ENTRY", "NoCacheEngine"]
