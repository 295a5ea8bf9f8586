"""Engine specs as the API takes them: a spec string or an `EngineSpec`, parsed by the parser
behind `--engine`."""

from __future__ import annotations

from larql.errors import InvalidInput
from larql.inference.engine import Engine
from larql.kv.catalog import parse_engine as parse_catalog_spec
from larql.kv.snapshots import State
from larql.kv.spec import EngineSpec

EngineLike = EngineSpec | str


def parse_engine(spec: str) -> EngineSpec:
    """An engine spec string (`turbo-quant:bits=4`) → its `EngineSpec`, by the parser behind
    `--engine`; a bad spec raises `EngineSpecError` naming what is wrong and what is accepted."""
    return parse_catalog_spec(spec)


def engine_spec(engine: EngineLike) -> EngineSpec:
    if isinstance(engine, EngineSpec):
        return engine
    if isinstance(engine, str):
        return parse_engine(engine)
    if isinstance(engine, Engine):
        raise InvalidInput(
            "a built engine holds one sequence's state; pass its spec (a string or "
            "larql.parse_engine(...)) and each call builds a fresh engine, or a larql.State "
            "(larql.prefill, larql.load_state) to continue a sequence"
        )
    if isinstance(engine, State):
        raise InvalidInput("this call starts from a prompt: pass an engine spec, not a State")
    raise InvalidInput(
        f"engine must be a spec string or an EngineSpec, got {type(engine).__name__}"
    )
