"""Eviction composed with a quantiser (`snapkv:budget=256+turbo-quant:bits=4`): the eviction
policy chooses the rows, the quantiser's store codes them (`spec`, `storage`)."""

from larql.kv.composed.spec import (
    ComposedSpec,
    CompositionRefused,
    composition_doc,
    parse_composed,
    what_composes,
)
from larql.kv.composed.storage import QuantisedStorage

__all__ = [
    "ComposedSpec",
    "CompositionRefused",
    "QuantisedStorage",
    "composition_doc",
    "parse_composed",
    "what_composes",
]
