"""What state is kept: the engine spec parser, the catalog and one module per engine."""

from larql.kv.catalog import CATALOG, from_name, split_specs, supported_names
from larql.kv.spec import EngineKind, EngineSpecError

__all__ = [
    "CATALOG",
    "EngineKind",
    "EngineSpecError",
    "from_name",
    "split_specs",
    "supported_names",
]
