"""larql as a library: load a model, parse an engine spec, generate or stream text, take
teacher-forced logits, and run the bench and accuracy harnesses — the same code paths the
`larql` command runs. `docs/API.md` documents every function with examples.

An engine *spec* (`parse_engine`'s `EngineSpec`) is an immutable description; every call builds
a fresh engine from it, so one spec serves any number of calls."""

from larql.api.engine_specs import parse_engine
from larql.api.generation import (
    Generation,
    generate,
    load_model,
    load_state,
    prefill,
    stream,
    teacher_forced_logits,
)
from larql.api.measure import accuracy, bench, parse_engines
from larql.api.resume_archive import Resumed, resume
from larql.errors import InvalidInput, LarqlError
from larql.inference.prefix_cache import PrefixCache
from larql.inference.snapshots import SnapshotError
from larql.kv.snapshots import State
from larql.kv.spec import EngineSpec, EngineSpecError
from larql.models.model import Model

__all__ = [
    "EngineSpec",
    "EngineSpecError",
    "Generation",
    "InvalidInput",
    "LarqlError",
    "Model",
    "PrefixCache",
    "Resumed",
    "SnapshotError",
    "State",
    "accuracy",
    "bench",
    "generate",
    "load_model",
    "load_state",
    "parse_engine",
    "parse_engines",
    "prefill",
    "resume",
    "stream",
    "teacher_forced_logits",
]
