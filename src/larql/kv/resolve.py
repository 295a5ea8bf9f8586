"""Which engine a command runs: `--engine` > `LARQL_KV_ENGINE` > legacy `--kv-cache` > standard
(docs/DESIGN.md, decision 3). A non-default `--kv-cache` next to an engine spec loses, with a
warning; so does a `--context-window` that sizes nothing, and `--kv-cache markov-bounded` without
one decodes unbounded, with a warning naming the flag."""

from __future__ import annotations

import os
from dataclasses import dataclass

from larql.kv.catalog import parse_engine
from larql.kv.spec import EngineSpec, EngineSpecError, MalformedEngineSpec

ENV_VAR = "LARQL_KV_ENGINE"
KV_CACHE_CHOICES = ("standard", "markov-bounded", "none")
_KV_CACHE_ALIASES = {
    "standard": "standard",
    "full": "standard",
    "fp32": "standard",
    "markov-bounded": "markov-bounded",
    "markov": "markov-bounded",
    "bounded": "markov-bounded",
    "sliding": "markov-bounded",
    "none": "none",
    "off": "none",
}


@dataclass(frozen=True)
class EngineChoice:
    engine: EngineSpec
    source: str  # "--engine", "LARQL_KV_ENGINE", "--kv-cache" or "default"
    warnings: tuple[str, ...] = ()


def parse_from(spec: str, source: str) -> EngineSpec:
    """`parse_engine`, a bad spec from the environment named as such: the user did not type
    it on this command line, and may have forgotten the variable is set."""
    if source != ENV_VAR:
        return parse_engine(spec)
    try:
        return parse_engine(spec)
    except EngineSpecError as e:
        raise type(e)(
            f"the environment variable {ENV_VAR}={spec!r} is not an engine spec "
            f"(unset it, or pass --engine to override it): {e}"
        ) from None


def resolve_engine(
    engine: str | None = None,
    kv_cache: str = "standard",
    context_window: int = 0,
    env: dict[str, str] | None = None,
) -> EngineChoice:
    env_spec = (os.environ if env is None else env).get(ENV_VAR) or None
    legacy = _KV_CACHE_ALIASES.get(kv_cache.strip().lower())
    if legacy is None:
        raise MalformedEngineSpec(
            f"unknown --kv-cache {kv_cache!r}; accepted: {', '.join(KV_CACHE_CHOICES)} "
            "(or use --engine SPEC)"
        )
    if context_window < 0:
        raise MalformedEngineSpec(f"--context-window must be ≥ 0, got {context_window}")
    spec, source = (engine, "--engine") if engine else (env_spec, ENV_VAR)
    if spec:
        warnings: tuple[str, ...] = ()
        if legacy != "standard":
            warnings = (f"--kv-cache {kv_cache} is ignored: {source} {spec!r} wins",)
        if context_window > 0:
            warnings += (f"--context-window {context_window} is ignored: {source} {spec!r} wins",)
        return EngineChoice(parse_from(spec, source), source, warnings)
    if legacy == "markov-bounded":
        if context_window > 0:
            return EngineChoice(parse_engine(f"standard:window={context_window}"), "--kv-cache")
        unbounded = (
            f"--kv-cache {kv_cache} without --context-window N keeps every token (unbounded "
            "standard); give --context-window N, or --engine standard:window=N",
        )
        return EngineChoice(parse_engine("standard"), "--kv-cache", unbounded)
    ignored: tuple[str, ...] = ()
    if context_window > 0:
        ignored = (
            f"--context-window {context_window} is ignored: it sizes --kv-cache markov-bounded "
            "only (or use --engine standard:window=N)",
        )
    if legacy == "none":
        return EngineChoice(parse_engine("no-cache"), "--kv-cache", ignored)
    return EngineChoice(parse_engine("standard"), "default", ignored)
