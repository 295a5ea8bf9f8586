"""The eviction engines users compare against: `snapkv` (compress once after the prefill by
what the prompt's last queries attend to) and `h2o` (heavy hitters by accumulated attention
plus the newest rows, evicting as decode proceeds)."""

from larql.kv.eviction.entry import H2O, SNAPKV
from larql.kv.eviction.h2o import H2oEngine
from larql.kv.eviction.snapkv import SnapKvEngine

__all__ = ["H2O", "SNAPKV", "H2oEngine", "SnapKvEngine"]
