"""The catalog is the one source of what the harnesses do with each engine: the specs bench,
accuracy and the long-context suites run by default, which engines re-run the whole context
(their long runs are capped), which FFN backends an engine refuses. A new engine's entry puts
it into every default sweep with no other edit."""

from __future__ import annotations

import pytest

from larql.harness.accuracy.run import default_specs as accuracy_specs
from larql.harness.bench.run import default_specs as bench_specs
from larql.inference.errors import BackendUnavailable
from larql.inference.ffn import FfnBackend
from larql.kv import CATALOG, parse_engine
from larql.kv.spec import EngineCatalog, EngineEntry
from larql.kv.standard import StandardEngine
from larql.models import Model

SUITES = ("bench", "accuracy", "longctx")


@pytest.mark.parametrize("suite", SUITES)
def test_every_default_spec_parses(suite: str) -> None:
    specs = CATALOG.default_specs(suite)
    assert specs and all(CATALOG.parses(s) for s in specs)


def test_the_harnesses_sweep_what_the_catalog_says() -> None:
    assert bench_specs() == CATALOG.default_specs("bench")
    assert accuracy_specs() == CATALOG.default_specs("accuracy")
    swept = {parse_engine(s).entry.name for s in bench_specs()}
    live = {e.name for e in CATALOG.entries if e.live_decode}
    assert swept == live  # every engine that decodes live runs in a default bench


def test_a_new_entry_runs_in_every_sweep() -> None:
    catalog = EngineCatalog(CATALOG.entries)
    catalog.register(
        EngineEntry(
            name="scratch",
            aliases=(),
            params=(),
            keeps="what standard keeps",
            contract="standard",
            factory=lambda p, model: StandardEngine(),
        )
    )
    for suite in SUITES:
        assert catalog.default_specs(suite)[-1] == "scratch"


def test_quadratic_and_refused_backends_come_from_the_entry(smollm2: Model) -> None:
    assert {e.name for e in CATALOG.entries if e.quadratic} == {"no-cache", "apollo"}

    class RemoteExperts(FfnBackend):
        kind = "remote experts"

        def forward(self, layer, x):
            return x

    engine = parse_engine("no-cache").build(smollm2)
    with pytest.raises(BackendUnavailable, match="no-cache cannot run with remote experts"):
        engine.prefill(smollm2, RemoteExperts(), [1, 2])
    parse_engine("standard").build(smollm2)._check_ffn(RemoteExperts())  # standard may
