"""The engine spec grammar (strict values; docs/DESIGN.md, decision 3), `split_specs`
(§3.4) and the engine choice precedence of `larql run` (§8.1)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from larql.kv import CATALOG, parse_engine, split_specs, supported_names
from larql.kv.resolve import ENV_VAR, resolve_engine
from larql.kv.spec import EngineSpecError, MalformedEngineSpec, UnknownEngine


@pytest.mark.parametrize(
    ("spec", "name", "params"),
    [
        (
            "standard",
            "standard",
            {"window": None, "sinks": 0, "graph": 1, "compile": 0, "attention": "auto"},
        ),
        (
            "standard:window=1024",
            "standard",
            {"window": 1024, "sinks": 0, "graph": 1, "compile": 0, "attention": "auto"},
        ),
        (
            "full",
            "standard",
            {"window": None, "sinks": 0, "graph": 1, "compile": 0, "attention": "auto"},
        ),
        (
            "FP32",
            "standard",
            {"window": None, "sinks": 0, "graph": 1, "compile": 0, "attention": "auto"},
        ),
        (
            "  standard  ",
            "standard",
            {"window": None, "sinks": 0, "graph": 1, "compile": 0, "attention": "auto"},
        ),
        (
            "markov-bounded:window=256",
            "standard",
            {"window": 256, "sinks": 0, "graph": 1, "compile": 0, "attention": "auto"},
        ),
        (
            "sliding",
            "standard",
            {"window": None, "sinks": 0, "graph": 1, "compile": 0, "attention": "auto"},
        ),
        (
            "standard: window = 8 ",
            "standard",
            {"window": 8, "sinks": 0, "graph": 1, "compile": 0, "attention": "auto"},
        ),
        ("none", "no-cache", {}),
        ("off", "no-cache", {}),
        ("no_cache", "no-cache", {}),
    ],
)
def test_parses(spec: str, name: str, params: dict) -> None:
    kind = parse_engine(spec)
    assert kind.display_name == name
    assert dict(kind.params) == params


@pytest.mark.parametrize(
    ("spec", "error", "fragment"),
    [
        ("", UnknownEngine, "empty spec"),
        ("unknown", UnknownEngine, "unknown engine 'unknown'"),
        ("markov", UnknownEngine, "supported: standard"),
        ("standard:window=abc", MalformedEngineSpec, "window='abc' is not an integer"),
        ("standard:window=0", MalformedEngineSpec, "must be ≥ 1"),
        ("standard:window=-3", MalformedEngineSpec, "must be ≥ 1"),
        ("standard:windw=4", MalformedEngineSpec, "unknown parameter 'windw'"),
        ("standard:window", MalformedEngineSpec, "is not key=value"),
        ("standard:window=4,window=5", MalformedEngineSpec, "given twice"),
        ("no-cache:window=4", MalformedEngineSpec, "takes no parameters"),
        ("standard:", MalformedEngineSpec, "a ':' but no parameters"),
        ("no-cache: ", MalformedEngineSpec, "a ':' but no parameters"),
    ],
)
def test_rejects_with_a_message_that_helps(spec: str, error: type, fragment: str) -> None:
    with pytest.raises(error) as raised:
        parse_engine(spec)
    assert fragment in str(raised.value)


def test_unknown_engine_lists_every_supported_engine() -> None:
    with pytest.raises(UnknownEngine) as raised:
        parse_engine("foo")
    for name in supported_names():
        assert name in str(raised.value)


def test_every_name_and_alias_round_trips() -> None:
    assert len(supported_names()) == len(set(supported_names())) == len(CATALOG.entries)
    for entry in CATALOG.entries:
        for name in entry.all_names:
            kind = parse_engine(name)
            assert kind.display_name == entry.name
            assert parse_engine(kind.spec()) == kind  # the canonical spec parses back


@given(st.text(max_size=40))
def test_any_string_parses_or_raises_a_typed_error(spec: str) -> None:
    try:
        kind = parse_engine(spec)
    except EngineSpecError as e:
        assert "supported: " + ", ".join(supported_names()) in str(e)
    else:
        assert kind.display_name in supported_names()


@given(
    st.sampled_from([n for e in CATALOG.entries for n in e.all_names]),
    st.lists(st.tuples(st.sampled_from(["window", "bits", "x", ""]), st.text(max_size=6))),
)
def test_parameter_soup_parses_or_raises_typed(name: str, pairs: list[tuple[str, str]]) -> None:
    spec = name + (":" + ",".join(f"{k}={v}" for k, v in pairs) if pairs else "")
    try:
        parse_engine(spec)
    except EngineSpecError as e:
        assert "supported: " + ", ".join(supported_names()) in str(e)


@pytest.mark.parametrize(
    ("specs", "expected"),
    [
        ("standard,no-cache", ["standard", "no-cache"]),
        ("standard:window=512,no-cache", ["standard:window=512", "no-cache"]),
        (" ; standard ;; no-cache ; ", ["standard", "no-cache"]),
        ("garbage,standard", ["garbage", "standard"]),
        (",,,", []),
        (";;;", []),
        ("", []),
    ],
)
def test_split_specs(specs: str, expected: list[str]) -> None:
    assert split_specs(specs) == expected


def test_split_specs_keeps_multi_parameter_specs_together() -> None:
    # a comma-separated parameter that cannot start a spec continues the previous one
    assert split_specs("standard:window=4,window=5") == ["standard:window=4,window=5"]


class TestPrecedence:
    def test_engine_flag_wins_over_env(self) -> None:
        choice = resolve_engine("no-cache", env={ENV_VAR: "standard:window=4"})
        assert (choice.engine.spec(), choice.source) == ("no-cache", "--engine")

    def test_env_wins_over_kv_cache(self) -> None:
        choice = resolve_engine(None, "none", env={ENV_VAR: "standard:window=4"})
        assert choice.engine.spec() == "standard:window=4"
        assert choice.warnings  # the ignored --kv-cache is reported

    def test_kv_cache_when_nothing_else(self) -> None:
        assert resolve_engine(None, "none", env={}).engine.spec() == "no-cache"
        bounded = resolve_engine(None, "markov-bounded", context_window=64, env={})
        assert bounded.engine.spec() == "standard:window=64"
        assert resolve_engine(None, "markov-bounded", env={}).engine.spec() == "standard"

    def test_default_is_unbounded_standard(self) -> None:
        choice = resolve_engine(None, env={})
        assert (choice.engine.spec(), choice.source, choice.warnings) == ("standard", "default", ())

    def test_default_kv_cache_with_engine_gives_no_warning(self) -> None:
        assert resolve_engine("no-cache", "standard", env={}).warnings == ()

    def test_unknown_kv_cache_is_an_error(self) -> None:
        with pytest.raises(MalformedEngineSpec, match="accepted: standard, markov-bounded, none"):
            resolve_engine(None, "foo", env={})
