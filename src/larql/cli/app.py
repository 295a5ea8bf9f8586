"""The `larql` command."""

from __future__ import annotations

import typer

from larql.cli.accuracy_cmd import accuracy
from larql.cli.apollo_cmd import apollo_app
from larql.cli.bench_cmd import bench
from larql.cli.boundary_cmd import boundary_app
from larql.cli.catalog_cmd import engines, models
from larql.cli.run_cmd import run
from larql.cli.serve_cmd import serve
from larql.cli.walk_cmd import walk

app = typer.Typer(
    name="larql",
    help="Decode with language models through pluggable KV engines, and measure them.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command()(run)
app.command()(walk)
app.command()(serve)
app.command()(engines)
app.command()(models)
app.command()(bench)
app.command()(accuracy)
app.add_typer(apollo_app, name="apollo")
app.add_typer(boundary_app, name="boundary")


def main() -> None:
    app()
