"""Engine plugins: a distribution's `larql.engines` entry points add engines to the catalog.

The example plugin (tests/fixtures/larql_plugin_example, `echo-standard`) is installed the way
an installer leaves it — its package on the path and a `*.dist-info` holding the entry points
its pyproject.toml declares — in a scratch directory that only the subprocesses see."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import larql
from helpers import first_layers, forget_package
from larql.kv import CATALOG
from larql.kv.plugins import GROUP, plugin_entries
from larql.kv.spec import EngineCatalog, UnknownEngine
from larql.models import Model

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "larql_plugin_example"
SRC = Path(larql.__file__).resolve().parents[1]
BUILTIN = CATALOG.entries
PROMPT = "The capital of France is"


def install(site: Path, dist: str, entry_points: dict[str, str]) -> None:
    """A `dist-info` as pip writes it: what `importlib.metadata` reads from a path entry."""
    info = site / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    lines = [f"{name} = {target}" for name, target in entry_points.items()]
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n" + "\n".join(lines) + "\n")


def install_example(site: Path) -> None:
    project = tomllib.loads((FIXTURE / "pyproject.toml").read_text())["project"]
    install(site, project["name"], project["entry-points"][GROUP])


def larql_cli(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LARQL_KV_ENGINE", "LARQL_NO_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(site), str(FIXTURE)])
    return subprocess.run(
        [sys.executable, "-m", "larql", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.slow
def test_a_plugin_engine_is_listed_and_decodes_like_standard(
    tmp_path: Path, smollm2_default: Model
) -> None:
    install_example(tmp_path)
    listed = larql_cli(tmp_path, "engines", "--output", "json")
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert rows["echo-standard"]["plugin"] == "larql-plugin-example"
    assert rows["echo-standard"]["aliases"] == ["echo"]
    assert rows["standard"]["plugin"] is None
    assert list(rows)[: len(BUILTIN)] == [e.name for e in BUILTIN]  # built-ins first
    run = larql_cli(tmp_path, "run", PROMPT, "-n", "8", "--output", "json", "--engine", "echo")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["engine"] == "echo-standard"
    standard = larql.generate(smollm2_default, "standard", PROMPT, max_new_tokens=8)
    assert out["tokens"] == standard.token_ids
    assert out["memory_bytes"] == standard.memory


def test_broken_and_clashing_plugins_get_one_line_each(tmp_path: Path) -> None:
    install_example(tmp_path)
    install(tmp_path, "larql-broken-plugin", {"broken": "larql_missing_module:ENTRY"})
    install(tmp_path, "larql-clashing-plugin", {"standard": "larql_plugin_example:CLASHING"})
    listed = larql_cli(tmp_path, "engines", "--output", "json")
    assert listed.returncode == 0, listed.stderr
    assert "Traceback" not in listed.stderr
    lines = listed.stderr.splitlines()
    assert len(lines) == 2, listed.stderr
    broken = next(x for x in lines if "'broken'" in x)
    assert broken.startswith("warning: engine plugin 'broken' (larql-broken-plugin")
    assert "ModuleNotFoundError" in broken and "larql_missing_module" in broken
    clash = next(x for x in lines if "'standard'" in x)
    assert "larql-clashing-plugin" in clash and "refused" in clash
    names = [r["name"] for r in json.loads(listed.stdout)]
    assert names == [e.name for e in BUILTIN] + ["echo-standard"]


@pytest.fixture
def example_on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(FIXTURE))
    forget_package("larql_plugin_example")
    yield
    forget_package("larql_plugin_example")


def catalog_with(*points: tuple[str, str]) -> EngineCatalog:
    found = [EntryPoint(name, value, GROUP) for name, value in points]
    return EngineCatalog(BUILTIN, extensions=lambda taken: plugin_entries(taken, found))


def test_a_plugin_parses_with_its_aliases_and_parameters(example_on_path: None) -> None:
    catalog = catalog_with(("echo-standard", "larql_plugin_example:ENTRY"))
    spec = catalog.parse("ECHO:window=4")
    assert spec.entry.name == "echo-standard" and spec.params == {"window": 4}
    assert spec.entry.plugin == "larql_plugin_example"  # no distribution: its module
    assert spec.build().name == "echo-standard"
    assert "echo-standard" in catalog.supported_message()
    with pytest.raises(UnknownEngine, match="echo-standard"):
        catalog.parse("echo-standrd")


@pytest.mark.parametrize(
    ("point", "message"),
    [
        (("broken", "larql_missing_module:ENTRY"), "was not loaded: ModuleNotFoundError"),
        (("echo-standard", "larql_plugin_example:build"), "is not a larql EngineEntry"),
        (("echo", "larql_plugin_example:ENTRY"), "must be the engine's name"),
        (("standard", "larql_plugin_example:CLASHING"), "'standard' is already an engine's"),
    ],
)
def test_an_unusable_plugin_is_left_out_with_one_warning(
    example_on_path: None, caplog: pytest.LogCaptureFixture, point: tuple[str, str], message: str
) -> None:
    catalog = catalog_with(point)
    with caplog.at_level(logging.WARNING, logger="larql.plugins"):
        names = catalog.supported_names()
    assert names == [e.name for e in BUILTIN]
    assert [r.getMessage() for r in caplog.records if message in r.getMessage()], caplog.text
    assert len(caplog.records) == 1
    assert catalog.parse("standard").entry is BUILTIN[0]


@pytest.mark.slow
def test_a_plugin_engine_runs_in_bench_and_accuracy(
    example_on_path: None, smollm2_default: Model
) -> None:
    model = first_layers(smollm2_default, 2)  # what is checked is the plugin's way through
    catalog = catalog_with(("echo-standard", "larql_plugin_example:ENTRY"))
    echo = catalog.parse("echo:window=4")
    bench = larql.bench(model, [echo], prompt_tokens=8, max_new_tokens=2, warmup=0, repeats=1)
    assert [r.spec for r in bench.rows] == ["echo-standard:window=4"]
    assert bench.rows[0].tok_s and bench.rows[0].memory.state > 0
    report = larql.accuracy(
        model,
        [catalog.parse("echo")],
        quick=True,
        parametric_n=4,
        positions=8,
        prompt_tokens=16,
        needle_max_tokens=0,
        conflict=False,
    )
    fidelity = report.fidelity[0]
    assert fidelity.spec == "echo-standard" and fidelity.mean_kl == 0.0
    assert fidelity.first_divergence is None


def test_a_second_plugin_cannot_take_a_first_ones_alias(
    example_on_path: None, caplog: pytest.LogCaptureFixture
) -> None:
    catalog = catalog_with(
        ("echo-standard", "larql_plugin_example:ENTRY"),
        ("echo-standard", "larql_plugin_example:ENTRY"),
    )
    with caplog.at_level(logging.WARNING, logger="larql.plugins"):
        assert catalog.supported_names().count("echo-standard") == 1
    assert "already an engine's" in caplog.text


def test_plugins_can_be_turned_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from larql.kv.plugins import installed

    install_example(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [ep.name for ep in installed()] == ["echo-standard"]
    monkeypatch.setenv("LARQL_NO_PLUGINS", "1")
    assert installed() == []
