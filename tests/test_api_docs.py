"""The Python examples of docs/API.md and of the README's "Python API" section run as written,
as the command examples of docs/CLI.md do (tests/test_readme_examples.py): each fenced block in
order, here in one namespace per document, so a block uses what an earlier one defined. A block
whose first line is `# file: PATH` is a file of a package, not a script: it is written under a
scratch directory, and the plugin it belongs to is installed from the document's `toml` block
and checked to decode like `standard`."""

from __future__ import annotations

import contextlib
import io
import re
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import larql
from helpers import forget_package
from larql.kv import CATALOG
from larql.kv.plugins import GROUP, plugin_entries
from larql.kv.spec import EngineCatalog

ROOT = Path(__file__).resolve().parents[1]
API_DOC = ROOT / "docs" / "API.md"
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
FILE_MARK = re.compile(r"^# file: (\S+)\n")


def fenced(text: str, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang == language]


def run_blocks(blocks: list[str], where: str) -> dict:
    namespace: dict = {"__name__": "__docs__"}
    for i, block in enumerate(blocks):
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                exec(compile(block, f"{where} block {i + 1}", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{where} block {i + 1} failed: {e!r}\n{block}") from e
    return namespace


def test_the_readme_python_example_runs() -> None:
    section = README.read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = fenced(section, "python")
    assert blocks and "larql.generate" in blocks[0]
    namespace = run_blocks(blocks, "README")
    assert namespace["result"].memory > 0 and namespace["logits"].ndim == 2


@pytest.mark.slow
def test_the_api_document_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = API_DOC.read_text()
    scripts = [b for b in fenced(text, "python") if not FILE_MARK.match(b)]
    files = [b for b in fenced(text, "python") if FILE_MARK.match(b)]
    assert len(scripts) >= 8 and len(files) == 1
    namespace = run_blocks(scripts, "docs/API.md")
    assert namespace["quantised"].memory < namespace["standard"].memory
    model = namespace["model"]
    prompt = "The capital of France is"
    whole = larql.generate(model, "markov-rs:window=64", prompt, max_new_tokens=8)
    assert "".join(namespace["pieces"]) == whole.text
    # the plugin: its files under a scratch directory, its entry points from the toml block
    for block in files:
        path = tmp_path / FILE_MARK.match(block).group(1)  # type: ignore[union-attr]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(FILE_MARK.sub("", block, count=1))
    monkeypatch.syspath_prepend(str(tmp_path))
    forget_package("larql_plugin_example")  # the fixture's copy, if a test imported it
    (toml,) = fenced(text, "toml")
    points = tomllib.loads(toml)["project"]["entry-points"][GROUP]
    found = [EntryPoint(name, value, GROUP) for name, value in points.items()]
    catalog = EngineCatalog(CATALOG.entries, lambda taken: list(plugin_entries(taken, found)))
    (name,) = points
    assert catalog.supported_names()[-1] == name
    assert catalog.parse(name).entry.factory.__module__ == "larql_plugin_example"
    plugin = larql.generate(model, catalog.parse("echo:window=64"), "Hello", max_new_tokens=6)
    standard = larql.generate(model, "standard:window=64", "Hello", max_new_tokens=6)
    assert plugin.token_ids == standard.token_ids
    forget_package("larql_plugin_example")


def test_the_document_names_every_api_function() -> None:
    text = API_DOC.read_text()
    for name in (
        "load_model",
        "parse_engine",
        "parse_engines",
        "generate",
        "stream",
        "teacher_forced_logits",
        "bench",
        "accuracy",
    ):
        assert f"larql.{name}(" in text, name
