"""The engine catalog: every engine larql can build, in display order. Each engine's package
exports its entry (names, parameters, what it keeps, its contract, its factory); `larql
engines`, the README table and the spec parser all read this list. Adding an engine is adding
its package and one line here — or, outside larql, a package with a `larql.engines` entry
point (`larql.kv.plugins`), whose engines follow the built-in ones."""

from __future__ import annotations

from typing import Any

from larql.kv import (
    apollo,
    boundary,
    composed,
    eviction,
    kv_quant,
    no_cache,
    residual,
    semantic_promotion,
    standard,
    turbo_quant,
    windowed_checkpoint,
)
from larql.kv.plugins import plugin_entries
from larql.kv.spec import EngineCatalog, EngineSpec, SpecPolicy

CATALOG = EngineCatalog(
    [
        standard.ENTRY,
        no_cache.ENTRY,
        residual.MARKOV_RS,
        residual.MARKOV_RS_CODEC,
        windowed_checkpoint.ENTRY,
        turbo_quant.ENTRY,
        kv_quant.ENTRY,
        eviction.SNAPKV,
        eviction.H2O,
        eviction.TOVA,
        eviction.KEYDIFF,
        eviction.EXPECTED_ATTENTION,
        eviction.KVZIP,
        apollo.ENTRY,
        boundary.ENTRY,
        residual.BOUNDARY_PER_LAYER,
        semantic_promotion.ENTRY,
    ],
    extensions=plugin_entries,
    composer=composed.parse_composed,
)


def catalog_rows() -> list[dict[str, Any]]:
    """The catalog as plain data (`larql engines --output json`, `GET /v1/engines`)."""
    return [
        {
            "name": e.name,
            "aliases": list(e.aliases),
            "params": [
                {
                    "name": p.name,
                    "type": p.type.__name__,
                    "default": p.default,
                    "doc": p.doc,
                    "kind": p.kind,
                    "bound": p.bound.dimension if p.bound else None,
                }
                for p in e.params
            ],
            "purpose": e.summary,
            "keeps": e.keeps,
            "contract": e.contract,
            "kind": e.kind,
            "live_decode": e.live_decode,
            "batching": e.batching or None,
            "plugin": e.plugin,
        }
        for e in CATALOG.entries
    ]


def parse_engine(spec: str, policy: SpecPolicy | None = None) -> EngineSpec:
    """`spec` → the engine it names; `policy` says who wrote it (None: the operator, who may
    name paths; `SpecPolicy.untrusted(model)` for a request)."""
    return CATALOG.parse(spec, policy)


def supported_names() -> list[str]:
    return CATALOG.supported_names()


def split_specs(specs: str) -> list[str]:
    return CATALOG.split_specs(specs)
