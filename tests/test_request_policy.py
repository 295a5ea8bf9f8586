"""What a request may not name: engine specs parsed under a request's `SpecPolicy` refuse paths
and file names at any depth of wrapping engines and every size past the model's or the server's
limits — as unit tests of the policy, through the HTTP API (fastapi's TestClient over
`create_app`), and as a property over every engine of the catalog and every one of its
parameters: only 200 or 4xx, and nothing written where the paths point."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from larql.api import generate
from larql.cli.app import app as cli_app
from larql.kv import CATALOG, parse_engine
from larql.kv.spec import (
    MAX_SPEC_DEPTH,
    BeyondBound,
    EngineEntry,
    EngineSpecError,
    MalformedEngineSpec,
    OperatorOnlyParameter,
    SpecPolicy,
    model_limits,
)
from larql.models import Model
from larql.server.app import create_app
from larql.server.settings import ServerSettings
from larql.specs import Param

MAX_PROMPT_TOKENS, MAX_NEW_TOKENS = 24, 8
SERVER_TOKENS = MAX_PROMPT_TOKENS + MAX_NEW_TOKENS  # the most one request's sequence reaches


def entries_with(kind: str) -> list[tuple[EngineEntry, Param]]:
    return [(e, p) for e in CATALOG.entries for p in e.params if p.kind == kind]


# ---------------------------------------------------------------------------- the policy


def test_every_parameter_declares_what_bounds_it() -> None:
    """A string that could be a path is declared a path, a name or a spec; an integer has a
    bound or a closed set of values — so a parameter added later cannot slip past the policy."""
    for entry in CATALOG.entries:
        for param in entry.params:
            if param.type is int:
                bounded = param.bound is not None or (param.check and param.check(10**12))
                assert bounded, f"{entry.name}:{param.name} is an unbounded integer"
            if param.type is str and param.kind == "value":
                assert param.check and param.check("/tmp/x"), f"{entry.name}:{param.name}"
    assert {(e.name, p.name) for e, p in entries_with("path")} == {
        ("boundary-kv", "archive"),
        ("apollo", "store"),
    }
    assert {(e.name, p.name) for e, p in entries_with("name")} == {("boundary-kv", "sequence_id")}


@pytest.mark.parametrize(
    ("spec", "engine", "param"),
    [
        ("boundary-kv:archive={p}", "boundary-kv", "archive"),
        ("apollo:store={p}", "apollo", "store"),
        ("semantic-promotion:base=boundary-kv:archive={p}", "boundary-kv", "archive"),
        ("promotion:base=boundary:chunk_tokens=4", None, None),  # the same wrapper, no path
        ("promotion:base=promotion:base=boundary:archive={p}/a/b", "boundary-kv", "archive"),
        ("promotion:base=promotion:base=promotion:base=apollo:store={p}", "apollo", "store"),
        ("boundary-kv:sequence_id=story", "boundary-kv", "sequence_id"),
        ("promotion:base=boundary-kv:sequence_id=story", "boundary-kv", "sequence_id"),
    ],
)
def test_a_request_names_no_path_at_any_depth(
    smollm2: Model, tmp_path: Path, spec: str, engine: str | None, param: str | None
) -> None:
    spec = spec.format(p=tmp_path / "touched")
    policy = SpecPolicy.untrusted(smollm2)
    if engine is None:
        assert parse_engine(spec, policy) == parse_engine(spec)
        return
    with pytest.raises(OperatorOnlyParameter) as refused:
        parse_engine(spec, policy)
    message = str(refused.value)
    assert message.startswith(f"{engine}: {param} names a ") and "\n" not in message
    assert "only the operator sets it (larql serve --engine)" in message
    assert parse_engine(spec).spec()  # the operator may name it
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "spec",
    [
        "boundary-kv:sequence_id=../../escaped",
        "boundary-kv:sequence_id=/tmp/escaped",
        "boundary-kv:sequence_id=a/b",
        "boundary-kv:sequence_id=.hidden",
        "boundary-kv:sequence_id=" + "x" * 129,
        "boundary-kv:archive={d},sequence_id=../escaped",
        "promotion:base=boundary-kv:sequence_id=../../escaped",
    ],
)
def test_a_name_is_a_plain_name_whoever_gives_it(smollm2: Model, tmp_path: Path, spec: str) -> None:
    spec = spec.format(d=tmp_path / "archive")
    with pytest.raises(MalformedEngineSpec, match=r"sequence_id=.* is not a plain name"):
        parse_engine(spec)  # the operator's
    with pytest.raises(EngineSpecError):  # a request's (an archive is refused first)
        parse_engine(spec, SpecPolicy.untrusted(smollm2))
    assert list(tmp_path.iterdir()) == []
    assert parse_engine("boundary-kv:sequence_id=run-2.v1_a").params["sequence_id"] == "run-2.v1_a"


def test_each_bound_is_named_in_the_refusal(smollm2: Model) -> None:
    config, limits = smollm2.config, model_limits(smollm2)
    layers, context, head_dim = config.num_layers, config.max_positions, limits["head_dim"].size
    policy, served = SpecPolicy.untrusted(smollm2), SpecPolicy.untrusted(smollm2, 100)
    refused = [
        (
            policy,
            "boundary-per-layer:layers=1000000000000",
            f"boundary-per-layer: layers=1000000000000 is more than the model's {layers} layers",
        ),
        (
            policy,
            f"apollo:layer={layers}",
            f"apollo: layer={layers} is out of range 0..{layers - 1} (the model's {layers} layers)",
        ),
        (policy, f"apollo:bos={config.vocab_size}", f"vocabulary of {config.vocab_size} ids"),
        (policy, f"kv-quant:group={head_dim + 1}", f"the model's head_dim of {head_dim}"),
        (policy, f"standard:window={context + 1}", f"the model's context of {context} tokens"),
        (policy, f"promotion:base=h2o:budget={10**30}", f"context of {context} tokens"),
        (
            served,
            "snapkv:window=101",
            "snapkv: window=101 is more than this server's limit of 100 tokens per request",
        ),
        (served, "turbo-quant:sinks=101", "turbo-quant: sinks=101"),
    ]
    for policy_, spec, words in refused:
        with pytest.raises(BeyondBound) as caught:
            parse_engine(spec, policy_)
        assert words in str(caught.value), spec
    for spec in (
        f"boundary-per-layer:layers={layers}",
        f"apollo:layer={layers - 1}",
        f"kv-quant:group={head_dim}",
        f"standard:window={context}",
    ):
        assert parse_engine(spec, policy) == parse_engine(spec)  # at the bound: accepted
    assert parse_engine("snapkv:window=100", served) == parse_engine("snapkv:window=100")
    assert parse_engine("snapkv", served).params["budget"] == 1024  # defaults are the engine's


def test_the_operator_gets_a_clean_error_for_what_cannot_work(smollm2: Model) -> None:
    """Without a policy the spec parses; building it for a model past that model's layers
    (or vocabulary) is a typed error, not a 10¹²-entry policy and a MemoryError."""
    kind = parse_engine("boundary-per-layer:layers=1000000000000")
    layers = smollm2.config.num_layers
    with pytest.raises(BeyondBound, match=f"more than the model's {layers} layers"):
        kind.build(smollm2)
    with pytest.raises(BeyondBound, match="vocabulary"):
        parse_engine("apollo:bos=10000000").build(smollm2)
    ran = CliRunner().invoke(
        cli_app, ["run", "Hi", "-n", "1", "--engine", "boundary-per-layer:layers=1000000000000"]
    )
    assert ran.exit_code == 2
    assert "error: boundary-per-layer: layers=1000000000000 is more than" in ran.stderr


def test_nesting_is_bounded_and_the_factory_gets_a_checked_spec() -> None:
    wrapped = parse_engine("semantic-promotion:base=standard:window=8")
    assert wrapped.params["base"] == parse_engine("standard:window=8")
    assert wrapped.spec() == "semantic-promotion:base=standard:window=8"
    assert parse_engine("promotion:base=full").spec() == "semantic-promotion"
    deep = "promotion:base=" * MAX_SPEC_DEPTH + "standard"
    with pytest.raises(MalformedEngineSpec, match=f"nests engines more than {MAX_SPEC_DEPTH}"):
        parse_engine(deep)


def test_the_operator_still_names_an_archive(smollm2: Model, tmp_path: Path) -> None:
    archive = tmp_path / "frames"
    spec = f"boundary-kv:archive={archive},chunk_tokens=4,sequence_id=story"
    assert parse_engine(spec).params["archive"] == str(archive)
    generate(smollm2, spec, "Once upon a time there was", max_new_tokens=2)
    assert any(archive.rglob("*"))  # frames written where the operator said


# ---------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def client(smollm2: Model) -> Iterator[TestClient]:
    settings = ServerSettings(max_prompt_tokens=MAX_PROMPT_TOKENS, max_new_tokens=MAX_NEW_TOKENS)
    with TestClient(create_app(smollm2, settings)) as running:
        yield running


def complete(
    client: TestClient, engine: str, max_tokens: int = 2, prompt: str = "Hi there"
) -> tuple[int, dict]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "engine": engine}
    response = client.post("/v1/completions", json=body)
    return response.status_code, response.json()


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("boundary-kv:archive={p}", "boundary-kv: archive names a path on the server"),
        ("semantic-promotion:base=boundary-kv:archive={p}", "archive names a path"),
        ("promotion:base=boundary:archive={p}/a/b", "archive names a path"),
        ("apollo:store={p}", "apollo: store names a path on the server"),
        ("boundary-kv:sequence_id=../../escaped", "sequence_id='../../escaped' is not a plain"),
        ("boundary-kv:sequence_id=story", "sequence_id names a file on the server"),
        ("boundary-per-layer:layers=1000000000000", "is more than the model's 30 layers"),
        ("standard:window=33", f"this server's limit of {SERVER_TOKENS} tokens per request"),
        ("markov-rs:window=" + "9" * 40, "markov-rs: window=9999"),
        ("standard:window=1," * 200 + "x", "at most 1024 characters"),
    ],
)
def test_the_server_answers_400_naming_the_engine_field(
    client: TestClient, tmp_path: Path, spec: str, words: str
) -> None:
    status, body = complete(client, spec.format(p=tmp_path / "touched"))
    assert status == 400, body
    assert body["error"]["param"] == "engine"
    assert words in body["error"]["message"]
    assert list(tmp_path.iterdir()) == [] and not (tmp_path.parent / "escaped").exists()


def test_the_servers_own_engine_may_name_an_archive(smollm2: Model, tmp_path: Path) -> None:
    archive = tmp_path / "frames"
    default = parse_engine(f"boundary-kv:archive={archive},chunk_tokens=2")
    with TestClient(create_app(smollm2, ServerSettings(default_engine=default))) as running:
        response = running.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert any(archive.rglob("*"))


def test_every_request_field_is_bounded(client: TestClient) -> None:
    long_stop = client.post("/v1/completions", json={"prompt": "Hi", "stop": "x" * 1025})
    assert long_stop.status_code == 400 and long_stop.json()["error"]["param"] == "stop"
    ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "stop": "x" * 64})
    assert ok.status_code == 200, ok.text


# ---------------------------------------------------------------------------- the property

INTEGERS = st.one_of(
    st.integers(-2, 9),
    st.integers(-(2**70), 2**70),
    st.sampled_from([10**12, 2**31, 2**63, 10**30]),
)
SMALL = st.sampled_from([1, 2, 3, 4])  # in range for every bounded parameter, on any model
WORDS = ["auto", "triton", "sdpa", "int", "fp8", "observe", "enforce", "none", "", "x", "1e3"]
# every parameter of every engine, one to focus each spec on (an engine without any: alone)
FOCUS = [(e, p) for e in CATALOG.entries for p in e.params or (None,)]
FILES = [(e, p) for e, p in FOCUS if p is not None and p.kind in ("path", "name")]


class Specs:
    """Engine specs from the catalog's own parameters: the one in focus valued in range, at
    and past its bound, huge, negative, path-like (absolute, or relative to the server's
    directory) or garbage, the others plausibly (where one bad value hides); a spec parameter
    nests another such spec."""

    def __init__(self, limits: dict, root: Path) -> None:
        self.limits = limits
        self.paths = [
            str(root / "p"),
            f"{root}/a/b",
            f"{root}/../{root.name}/c",
            str(root),
            "story",
            "x/y",
            "../escaped",
            "../../escaped",
            ".hidden",
        ]

    def value(self, param: Param, depth: int) -> st.SearchStrategy[str]:
        if param.kind == "spec":
            inner = st.sampled_from(FOCUS).flatmap(lambda f: self.spec(*f, depth + 1))
            return st.one_of(inner, st.text(max_size=12)) if depth < 3 else st.just("standard")
        if param.kind in ("path", "name"):
            return st.sampled_from(self.paths)
        if param.type is int:
            edges = [0, 2**63]
            if param.bound is not None:
                size = self.limits[param.bound.dimension].size
                edges = [size - 1, size, size + 1]
            ints = st.one_of(SMALL, st.sampled_from(edges), INTEGERS)
            return st.one_of(ints.map(str), st.sampled_from(WORDS))
        if param.type is float:
            return st.sampled_from(["1.5", "0", "-1", "nan", "inf", "1e308", "x"])
        return st.sampled_from(WORDS)

    def plausible(self, param: Param) -> st.SearchStrategy[str]:
        if param.kind in ("path", "name"):
            return st.sampled_from(self.paths)
        if param.kind == "spec":
            return st.just("standard")
        if param.type is int:
            return SMALL.map(str)
        return st.sampled_from(["1.5"] if param.type is float else WORDS)

    def spec(self, entry: EngineEntry, focus: Param | None, depth: int = 0) -> st.SearchStrategy:
        """`focus` given a value, alone, with up to two of the engine's other parameters, or
        alone inside one to three semantic-promotion wrappers (a wrapped spec has no commas)."""
        name = st.sampled_from(entry.all_names)
        if focus is None:
            return name
        own = self.value(focus, depth).map(lambda v: f"{focus.name}={v}")
        alone = st.tuples(name, own).map(":".join)
        if depth > 0:
            return alone
        others = st.lists(
            st.sampled_from([p for p in entry.params if p is not focus]),
            unique_by=lambda p: p.name,
            min_size=1,
            max_size=2,
        ).flatmap(
            lambda ps: st.tuples(
                *(self.plausible(p).map(lambda v, p=p: f"{p.name}={v}") for p in ps)
            )
        )
        together = st.tuples(alone, others).map(lambda t: ",".join((t[0], *t[1])))
        wrapped = st.tuples(st.integers(1, 3), alone).map(lambda t: "promotion:base=" * t[0] + t[1])
        return st.one_of(alone, wrapped, together) if len(entry.params) > 1 else alone


def files_under(root: Path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, n), root)
        for d, dirs, files in os.walk(root)
        for n in dirs + files
    )


@pytest.mark.slow
def test_any_engine_spec_from_a_request_is_200_or_4xx_and_writes_nothing(
    client: TestClient, smollm2: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server runs in this process: from a directory two levels under the temp root, so
    relative paths (`story`, `../../escaped`) land under it as the absolute ones do."""
    root, server_dir = tmp_path, tmp_path / "a" / "b"
    server_dir.mkdir(parents=True)
    monkeypatch.chdir(server_dir)
    limits = model_limits(smollm2, SERVER_TOKENS)
    built = Specs(limits, root)
    specs = st.one_of(
        st.sampled_from(FOCUS).flatmap(lambda f: built.spec(*f)),
        st.sampled_from(FILES).flatmap(lambda f: built.spec(*f)),  # the operator's parameters
        st.text(max_size=30),
    )
    seen: dict[int, int] = {}

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(spec=specs, max_tokens=st.integers(1, 2))
    @example(f"boundary-kv:archive={root}/x,chunk_tokens=1", 2)  # the attacks known, always
    @example(f"promotion:base=promotion:base=boundary:archive={root}/a/b", 2)
    @example("boundary-kv:chunk_tokens=2,sequence_id=../../escaped,archive=story", 2)
    @example("boundary-per-layer:layers=1000000000000", 1)
    @example(f"boundary-kv:window={10**30}", 1)
    def answer(spec: str, max_tokens: int) -> None:
        status, body = complete(client, spec, max_tokens, "Once upon a time there was")
        seen[status] = seen.get(status, 0) + 1
        assert status == 200 or 400 <= status < 500, (spec, status, json.dumps(body)[:300])
        if status != 200:
            assert body["error"]["param"] == "engine", (spec, body)
        assert files_under(root) == ["a", "a/b"], spec

    answer()
    assert seen.get(200) and seen.get(400), seen  # both sides of the policy were exercised
