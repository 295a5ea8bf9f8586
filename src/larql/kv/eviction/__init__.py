"""The eviction engines: one scorer base (`ScoringEngine`: a score per prompt row and K/V
head, the selection shared — keep=/budget=, sinks, recent, heads=uniform|adaptive) and its
scorers: `snapkv` (the prompt's last queries vote), `h2o` (accumulated attention, evicting as
decode proceeds), `tova` (the newest query's attention), `keydiff` (key dissimilarity),
`expected-attention` (the expected attention of future queries) and `kvzip` (the attention the
context's reconstruction needs)."""

from larql.kv.eviction.entry import EXPECTED_ATTENTION, H2O, KEYDIFF, KVZIP, SNAPKV, TOVA
from larql.kv.eviction.expected_attention import ExpectedAttentionEngine
from larql.kv.eviction.h2o import H2oEngine
from larql.kv.eviction.keydiff import KeyDiffEngine
from larql.kv.eviction.kvzip import KvZipEngine
from larql.kv.eviction.snapkv import SnapKvEngine
from larql.kv.eviction.tova import TovaEngine

__all__ = [
    "EXPECTED_ATTENTION",
    "H2O",
    "KEYDIFF",
    "KVZIP",
    "SNAPKV",
    "TOVA",
    "ExpectedAttentionEngine",
    "H2oEngine",
    "KeyDiffEngine",
    "KvZipEngine",
    "SnapKvEngine",
    "TovaEngine",
]
