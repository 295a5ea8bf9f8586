"""The `larql` command. The command modules import torch and the models inside their bodies,
so `larql --help`, `-h` and `--version` answer without loading them."""

from __future__ import annotations

from typing import Annotated

import typer

import larql
from larql.cli.accuracy_cmd import accuracy
from larql.cli.apollo_cmd import apollo_app
from larql.cli.bench_cmd import bench
from larql.cli.boundary_cmd import boundary_app
from larql.cli.cache_cmd import cache_app
from larql.cli.catalog_cmd import engines, models
from larql.cli.environment import unread_warning
from larql.cli.memory_cmd import memory
from larql.cli.run_cmd import run
from larql.cli.serve_cmd import serve
from larql.cli.walk_cmd import walk

app = typer.Typer(
    name="larql",
    help="Decode with language models through pluggable KV engines, and measure them.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # subcommands inherit it
)


def show_version(asked: bool) -> None:
    if asked:
        typer.echo(f"larql {larql.__version__}")
        raise typer.Exit()


@app.callback()
def larql_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=show_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Decode with language models through pluggable KV engines, and measure them."""
    warning = unread_warning()
    if warning is not None:
        typer.echo(warning, err=True)


app.command()(run)
app.command()(walk)
app.command()(serve)
app.command()(engines)
app.command()(models)
app.command()(memory)
app.command()(bench)
app.command()(accuracy)
app.add_typer(apollo_app, name="apollo")
app.add_typer(boundary_app, name="boundary")
app.add_typer(cache_app, name="cache")


def main() -> None:
    app()
