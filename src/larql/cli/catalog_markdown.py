"""The engine catalog as a markdown page (`larql engines --output markdown`): docs/ENGINES.md is
this page, so the catalog's entries are the one place its facts are written."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from larql.kv.composed import composition_doc
from larql.kv.spec import EngineEntry
from larql.specs import Param

LIVE_COMMANDS = "`run`, `walk`, `serve`, `bench`, `accuracy`"
MEASURE_COMMANDS = "`bench`, `accuracy`"
DIMENSIONS = {  # how a `Bound.dimension` reads in a sentence
    "tokens": "the context",
    "layers": "the model's layers",
    "heads": "the model's heads",
    "head_dim": "the model's head_dim",
    "vocab": "the vocabulary",
}

HEADER = """\
# Engines

Every KV engine larql can build, with its names, parameters, what it keeps and what it
promises. This page is printed by `larql engines --output markdown` from the engine catalog
(`src/larql/kv/catalog.py`); docs/ENGINES.md is that output and a test keeps it so.

A spec is `name` or `name:key=value[,key=value…]`: names are case-insensitive, parameters are
strict (docs/CLI.md, "Engine specs"). Which engine to pick, with measured bytes, fidelity and
speed: README.md, "Which engine for what"; what these one-line fields leave out:
docs/ARCHITECTURE.md, "Engines in detail".
"""


def catalog_markdown(entries: Sequence[EngineEntry]) -> str:
    """The page: a summary table, then one section per engine in catalog order."""
    parts = [HEADER, summary_table(entries), composition_section(entries)]
    parts += [engine_section(e) for e in entries]
    return "\n".join(parts)


def summary_table(entries: Iterable[EngineEntry]) -> str:
    lines = [
        "| engine | aliases | parameters | live decode | batches |",
        "|---|---|---|---|---|",
    ]
    for e in entries:
        aliases = ", ".join(f"`{a}`" for a in e.aliases) or "—"
        params = ", ".join(f"`{p.name}`" for p in e.params) or "—"
        live = "yes" if e.live_decode else "no"
        batches = "yes" if e.batching else "no"
        lines.append(f"| [`{e.name}`](#{e.name}) | {aliases} | {params} | {live} | {batches} |")
    return "\n".join(lines) + "\n"


def composition_section(entries: Sequence[EngineEntry]) -> str:
    return "\n".join(["## Composing eviction with quantisation", "", composition_doc(entries), ""])


def engine_section(e: EngineEntry) -> str:
    lines = [f"## {e.name}", ""]
    if e.plugin is not None:
        lines += [f"A plugin, from the distribution `{e.plugin}`.", ""]
    if e.live_decode:
        runs = f"Runs in {LIVE_COMMANDS}."
    else:
        runs = f"A {e.kind} engine: runs in {MEASURE_COMMANDS} only (no live decode)."
    lines += [f"Aliases: {aliases(e)}. {runs}", ""]
    if e.params:
        lines += [
            "| parameter | type | default | meaning | limits |",
            "|---|---|---|---|---|",
            *(param_row(p) for p in e.params),
            "",
        ]
    else:
        lines += ["No parameters.", ""]
    batching = e.batching or "no: each session steps alone"
    lines += [
        f"- **Keeps:** {cell(e.keeps)}",
        f"- **Contract:** {cell(e.contract)}",
        f"- **Batching** (`larql serve`, `bench --batch`): {cell(batching)}",
        f"- **Run by default** (when no engines are given): {sweeps(e)}",
    ]
    if e.quadratic:
        lines.append("- **Cost:** re-runs the whole context every step (O(N²)); long runs capped")
    for kind, why in e.refuses_ffn.items():
        lines.append(f"- **Refuses** {kind} FFN backends: it {cell(why)}")
    return "\n".join([*lines, ""])


def sweeps(e: EngineEntry) -> str:
    """Which specs of the engine each harness runs by default (`EngineEntry.sweeps`)."""
    said = []
    suites = {"bench": "`bench`", "accuracy": "`accuracy`", "longctx": "the long-context suites"}
    for suite, where in suites.items():
        specs = e.sweeps.specs(e.name, suite)
        said.append(f"{where}: " + (", ".join(f"`{s}`" for s in specs) or "none"))
    return "; ".join(said)


def aliases(e: EngineEntry) -> str:
    if not e.aliases:
        return "none"
    shown = []
    for alias in e.aliases:
        fixed = e.fixed.get(alias)
        sets = ", ".join(f"{k}={v}" for k, v in fixed.items()) if fixed else ""
        shown.append(f"`{alias}` ({sets})" if sets else f"`{alias}`")
    return ", ".join(shown)


def param_row(p: Param) -> str:
    default = "none" if p.default is None else f"`{p.default}`"
    return f"| `{p.name}` | {p.type.__name__} | {default} | {cell(p.doc)} | {param_limits(p)} |"


def param_limits(p: Param) -> str:
    """What a policy checks beyond the type (`Param.kind`, `Param.bound`), in words."""
    said = []
    if p.kind == "path":
        said.append("a path on the machine: the operator's specs only")
    elif p.kind == "name":
        said.append("a plain file name: the operator's specs only")
    elif p.kind == "spec":
        said.append("an engine spec, parsed under the same policy")
    if p.bound is not None:
        relation = "<" if p.bound.index else "≤"
        where = DIMENSIONS.get(p.bound.dimension, p.bound.dimension)
        # `always`: past it the engine cannot work; otherwise it limits what a request may hold
        whose = "every spec, once the model is known" if p.bound.always else "a request's spec"
        said.append(f"{relation} {where} (checked on {whose})")
    return "; ".join(said) or "—"


def cell(text: str) -> str:
    """Text safe inside a table row or a one-line list item."""
    return " ".join(text.split()).replace("|", "\\|")
