"""`larql engines` and `larql models`: what can be chosen, and what is installed."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from larql.cli.common import InvalidInput, stdout, user_errors


@user_errors
def engines(
    output: Annotated[
        str,
        typer.Option(
            "--output", "-o", help="table, json or markdown (the page docs/ENGINES.md is)."
        ),
    ] = "table",
) -> None:
    """List the engine catalog: names, parameters, what each keeps and its contract."""
    from larql.cli.catalog_markdown import catalog_markdown
    from larql.kv.catalog import CATALOG, catalog_rows
    from larql.kv.composed import composition_doc

    if output == "json":
        print(json.dumps(catalog_rows(), indent=2))
        return
    if output == "markdown":
        print(catalog_markdown(CATALOG.entries), end="")
        return
    if output != "table":
        raise InvalidInput(f"unknown --output {output!r}; accepted: table, json, markdown")
    table = Table(title="KV engines", show_lines=True)
    columns = ("engine", "aliases", "parameters (default)", "keeps", "contract", "live", "batched")
    for column in columns:
        table.add_column(column, overflow="fold")
    for e in CATALOG.entries:
        params = "\n".join(p.describe() for p in e.params) or "—"
        live = "yes" if e.live_decode else "no (bench/accuracy)"
        name = e.name if e.plugin is None else f"{e.name}\n(plugin: {e.plugin})"
        batched = e.batching or "no: steps alone"
        aliases = ", ".join(e.aliases) or "—"
        table.add_row(name, aliases, params, e.keeps, e.contract, live, batched)
    stdout.print(table)
    stdout.print(composition_doc(CATALOG.entries).replace("`", ""))


@user_errors
def models(
    output: Annotated[str, typer.Option("--output", "-o", help="table or json.")] = "table",
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
    if output == "json":
        print(json.dumps(rows, indent=2))
        return
    if output != "table":
        raise InvalidInput(f"unknown --output {output!r}; accepted: table, json")
    table = Table(title="Models (-m NAME; or -m path/to/model.gguf, or an HF directory)")
    for column in ("name", "architecture", "licence", "installed"):
        table.add_column(column, overflow="fold")
    for r in rows:
        name = r["name"] + (" (default)" if r["default"] else "")
        status = f"yes: {r['path']}" if r["installed"] else f"no — {r['install']}"
        table.add_row(name, r["architecture"], r["licence"], status)
    stdout.print(table)
