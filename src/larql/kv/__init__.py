"""What state is kept: the engine spec parser, the catalog and one module per engine."""

from larql.kv.catalog import CATALOG, parse_engine, split_specs, supported_names
from larql.kv.spec import EngineEntry, EngineSpec, EngineSpecError

__all__ = [
    "CATALOG",
    "EngineEntry",
    "EngineSpec",
    "EngineSpecError",
    "parse_engine",
    "split_specs",
    "supported_names",
]
