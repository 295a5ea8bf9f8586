"""`standard`: the full K/V cache (optionally a sliding window), eager everywhere and through a
static cache and a captured CUDA graph on a GPU."""

from larql.kv.standard.engine import StandardEngine
from larql.kv.standard.entry import ENTRY, WINDOW_DOC
from larql.kv.standard.static import StaticCache

__all__ = ["ENTRY", "WINDOW_DOC", "StandardEngine", "StaticCache"]
