"""The package's imports point down the layers and never go round in a circle:

    larql (errors, specs, data) ← models ← inference, kernels, parallel ← kv ← harness, server
        ← api ← cli
                                                                        (and `python -m larql`)

The root package `larql` is the library's face: its names are `larql.api`'s, imported on first
use, so it sits on the api layer.

Every import counts, at the top of a module or inside a function, and a circle inside one
package counts as any other: a module that imports a name from its own package's `__init__`
while that `__init__` re-exports the module is a circle. `from package import module` reaches
the module, not the package's `__init__`."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
LAYER = {
    "models": 1,
    "inference": 2,
    "kernels": 2,
    "parallel": 2,
    "kv": 3,
    "harness": 4,
    "server": 4,
    "api": 5,
    "cli": 6,
    "__main__": 6,
}
ROOT = "larql"


def modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "larql").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                named = [f"{base}.{alias.name}" for alias in node.names]
                # names that are all modules: an import of those modules, not of `base`'s names
                targets = named if all(n in mods for n in named) else [base, *named]
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def layer_of(module: str) -> int:
    if module == ROOT:
        return LAYER["api"]
    parts = module.split(".")
    return LAYER.get(parts[1], 0) if len(parts) > 1 else 0


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return [c for c in found if len(c) > 1]


def test_no_import_circle() -> None:
    assert circles(import_graph()) == []


def test_no_import_runs_up_the_layers() -> None:
    upward = [
        f"{m} -> {t}"
        for m, targets in import_graph().items()
        for t in sorted(targets)
        if layer_of(t) > layer_of(m)
    ]
    assert upward == []


def test_the_checks_see_a_circle_and_an_upward_import() -> None:
    """The checks are not vacuous: a graph with both faults is caught."""
    graph = {"larql.kv.a": {"larql.kv.b"}, "larql.kv.b": {"larql.kv.a", "larql.cli.x"}}
    graph["larql.cli.x"] = set()
    assert circles(graph) == [["larql.kv.a", "larql.kv.b"]]
    assert layer_of("larql.cli.x") > layer_of("larql.kv.b")
    assert len(import_graph()) > 50  # it read the package


def test_a_circle_inside_one_package_is_caught() -> None:
    """Two engines' modules of one package importing each other, and a package whose
    `__init__` re-exports a module that imports a name from that `__init__`, are circles."""
    siblings = {"larql.kv.catalog": {"larql.kv.semantic_promotion"}}
    siblings["larql.kv.semantic_promotion"] = {"larql.kv.catalog"}
    assert circles(siblings) == [["larql.kv.catalog", "larql.kv.semantic_promotion"]]
    through_init = {"larql.kv": {"larql.kv.catalog"}, "larql.kv.catalog": {"larql.kv"}}
    assert circles(through_init) == [["larql.kv", "larql.kv.catalog"]]


def test_importing_a_submodule_through_its_package_is_an_edge_to_the_submodule() -> None:
    """`from larql.kv.turbo_quant import planes` (in turbo-quant's kernel path) reaches
    `planes`; it does not make the module depend on the package's `__init__`."""
    graph = import_graph()
    kernel_path = graph["larql.kv.turbo_quant.kernel_path"]
    assert "larql.kv.turbo_quant.planes" in kernel_path
    assert "larql.kv.turbo_quant" not in kernel_path
