"""`larql engines` and `larql models`: what can be chosen, and what is installed."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from larql.cli.common import stdout, user_errors
from larql.cli.renamed import output_format


def spelling_variants(name: str, aliases: tuple[str, ...]) -> list[str]:
    """The aliases that are more than the name (or another alias) with `_` for `-`: the
    compact table leaves those out (the catalog accepts them all)."""
    dashed = {name, *(a for a in aliases if "_" not in a)}
    return [a for a in aliases if a.replace("_", "-") not in dashed or "_" not in a]


@user_errors
def engines(
    output: Annotated[
        str,
        typer.Option(
            "--output", "-o", help="text, json or markdown (the page docs/ENGINES.md is)."
        ),
    ] = "text",
    verbose: Annotated[
        bool,
        typer.Option(
            "-v",
            "--verbose",
            help="The full catalog: parameters and defaults, what each keeps, its contract.",
        ),
    ] = False,
) -> None:
    """List the engines: name, aliases and what each is for (-v: the full catalog)."""
    from larql.cli.catalog_markdown import catalog_markdown
    from larql.harness.formatting import Unbroken
    from larql.kv.catalog import CATALOG, catalog_rows
    from larql.kv.composed import composition_doc

    output = output_format(output, ("text", "json", "markdown"))
    if output == "json":
        print(json.dumps(catalog_rows(), indent=2))
        return
    if output == "markdown":
        print(catalog_markdown(CATALOG.entries), end="")
        return
    if not verbose:
        table = Table(
            title="KV engines (--engine NAME[:key=value,…])",
            caption="larql engines -v: parameters, what each keeps, its contract",
            caption_justify="left",
        )
        for column in ("engine", "what it is for", "aliases"):
            table.add_column(column)
        for e in CATALOG.entries:
            name = e.name if e.plugin is None else f"{e.name} (plugin)"
            aliases = ", ".join(spelling_variants(e.name, e.aliases)) or "—"
            table.add_row(name, e.summary, aliases)
        stdout.print(
            "An eviction composes with a quantiser: EVICTION+QUANTISER, e.g. "
            "snapkv:keep=0.5+turbo-quant:bits=4 (-v: which compose)."
        )
        stdout.print(Unbroken(table, ("aliases",)))
        return
    for e in CATALOG.entries:  # one small table per engine: it fits 80 columns
        table = Table(title=e.name, show_header=False, title_justify="left")
        table.add_column("field", style="bold")
        table.add_column("value")
        if e.plugin is not None:
            table.add_row("plugin", e.plugin)
        table.add_row("for", e.summary)
        table.add_row("aliases", ", ".join(e.aliases) or "—")
        table.add_row("parameters", "\n".join(p.describe() for p in e.params) or "—")
        table.add_row("keeps", e.keeps)
        table.add_row("contract", e.contract)
        table.add_row("live decode", "yes" if e.live_decode else "no (bench and accuracy only)")
        table.add_row("batches", e.batching or "no: each session steps alone")
        stdout.print(Unbroken(table))
    stdout.print(composition_doc(CATALOG.entries).replace("`", ""))


@user_errors
def models(
    output: Annotated[str, typer.Option("--output", "-o", help="text or json.")] = "text",
    verbose: Annotated[
        bool, typer.Option("-v", "--verbose", help="Also what each model is (its description).")
    ] = False,
) -> None:
    """List the models larql knows by name and whether each is installed."""
    from larql.models.registry import DEFAULT_MODEL, KNOWN_MODELS

    rows = []
    for known in KNOWN_MODELS.values():
        path = known.locate()
        rows.append(
            {
                "name": known.name,
                "default": known.name == DEFAULT_MODEL,
                "architecture": known.architecture,
                "description": known.description,
                "licence": known.licence,
                "installed": path is not None,
                "path": str(path) if path else None,
                "install": known.install,
            }
        )
    output = output_format(output, ("text", "json"))
    if output == "json":
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="Models (-m NAME; or -m path/to/model.gguf, or an HF directory)")
    columns = ("name", "architecture", "licence", "installed", *(("description",) * verbose))
    for column in columns:
        table.add_column(column, overflow="fold")
    for r in rows:
        name = r["name"] + (" (default)" if r["default"] else "")
        status = f"yes: {r['path']}" if r["installed"] else f"no — {r['install']}"
        cells = (name, r["architecture"], r["licence"], status, *((r["description"],) * verbose))
        table.add_row(*cells)
    stdout.print(table)
