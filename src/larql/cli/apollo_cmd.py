"""`larql apollo …`: tools for the apollo retrieval engine. `build-store` turns a text file into
the store `--engine apollo:store=DIR` serves from (bench and accuracy; not live decode)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from larql.cli.common import InvalidInput, open_model, stdout, user_errors
from larql.cli.options import DeviceOption, DtypeOption, ModelOption, ThreadsOption, WeightsOption

apollo_app = typer.Typer(
    name="apollo",
    help="Build and inspect stores for the apollo retrieval engine.",
    no_args_is_help=True,
)


@apollo_app.command("build-store")
@user_errors
def build_store_command(
    corpus: Annotated[Path, typer.Option("--corpus", help="UTF-8 text file to index.")],
    out: Annotated[Path, typer.Option("--out", help="Store directory to create.")],
    model: ModelOption = None,
    window: Annotated[int | None, typer.Option(help="Tokens per window (default 128).")] = None,
    crystal_layer: Annotated[
        int | None,
        typer.Option(
            help="Layer whose incoming residual is each window's boundary (default: "
            "half the depth)."
        ),
    ] = None,
    injection_layer: Annotated[
        int | None,
        typer.Option(help="Layer after which the engine injects (default: 7/8 of the depth)."),
    ] = None,
    entries_per_window: Annotated[
        int | None, typer.Option(help="Most fact entries kept per window (default 16).")
    ] = None,
    residuals: Annotated[
        bool,
        typer.Option(
            "--residuals/--no-residuals",
            help="Store window boundaries (compressed); without them the engine re-reads the "
            "window's tokens.",
        ),
    ] = True,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    weights: WeightsOption = "auto",
    threads: ThreadsOption = None,
) -> None:
    """Build an apollo store from a text file: windows of tokens, each window's boundary
    residual at the crystal layer, and fact entries weighted by rarity."""
    from larql.kv.apollo.builder import BuildOptions, build_store

    if not corpus.is_file():
        raise InvalidInput(f"--corpus {corpus} is not a file")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidInput(f"--out {out} already exists and is not empty; choose a new directory")
    try:
        text = corpus.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInput(f"--corpus {corpus} is not UTF-8 text ({e.reason})") from None
    lm = open_model(model, dtype, device, threads, weights)
    sizes = {"window": window, "entries_per_window": entries_per_window}
    options = BuildOptions(
        crystal_layer=crystal_layer,
        injection_layer=injection_layer,
        residuals=residuals,
        **{name: value for name, value in sizes.items() if value is not None},
    )
    store = build_store(lm, text, options)
    store.save(out)
    m = store.manifest
    mode = f"compressed, crystal layer {m.crystal_layer}" if residuals else "uncompressed"
    stdout.print(f"apollo store for {lm.name} written to {out} ({mode})")
    stdout.print(
        f"  windows: {m.num_windows} of ≤{m.window_size} tokens   tokens: {m.num_tokens}   "
        f"entries: {m.num_entries}   injection layer: {m.arch_config.injection_layer}"
    )
    stdout.print(f"  bytes: {store.total_bytes():,}")
    stdout.print(
        f"  use it with `larql bench` or `larql accuracy`: --engine apollo:store={out} "
        "(a retrieval engine: run, walk and serve do not take it)"
    )
