"""`larql memory`: every engine's bytes for a model and a length, counted by the engines' own
code over the model's structure (no weight read, no value computed)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from larql.cli.common import InvalidInput, stdout, user_errors
from larql.cli.engine_names import engines_help
from larql.cli.options import DtypeOption, ModelOption
from larql.cli.renamed import output_format, renamed
from larql.harness.formatting import Unbroken

if TYPE_CHECKING:  # torch loads in the command's body, not for `--help`
    from larql.harness.memory import MemoryPrediction

OUTPUTS = ("text", "json")


@user_errors
def memory(
    prompt_tokens: Annotated[
        int | None,
        typer.Option(
            "--prompt-tokens", help="The prompt's length in tokens: the length to count at."
        ),
    ] = None,
    model: ModelOption = None,
    max_tokens: Annotated[
        int,
        typer.Option(
            "-n",
            "--max-tokens",
            help="New tokens of the run counted, as larql run's -n (the engine then holds "
            "prompt tokens + n − 1 positions; the growth reserve follows what the run expects).",
        ),
    ] = 1,
    engines: Annotated[
        str | None,
        typer.Option(
            "--engine",
            help="Engine specs (; or , separated); default: every live engine with its "
            f"defaults and as the long-context suites run it. {engines_help()}",
        ),
    ] = None,
    old_tokens: Annotated[
        int | None, typer.Option("--tokens", hidden=True, help="Old spelling of --prompt-tokens.")
    ] = None,
    old_engines: Annotated[
        str | None, typer.Option("--engines", hidden=True, help="Old spelling of --engine.")
    ] = None,
    dtype: DtypeOption = "float32",
    output: Annotated[str, typer.Option("--output", "-o", help="text or json.")] = "text",
) -> None:
    """Predict every engine's bytes (state by tier, growth reserve) for a model and a length,
    without reading the weights: the engines' own code counts them over the model's shapes."""
    output = output_format(output, OUTPUTS)
    tokens = renamed(prompt_tokens, old_tokens, "--prompt-tokens", "--tokens", None)
    engines = renamed(engines, old_engines, "--engine", "--engines", None)
    if tokens is None:
        raise InvalidInput("give --prompt-tokens N: the prompt's length in tokens to count at")
    if tokens < 1:
        raise InvalidInput(f"--prompt-tokens must be ≥ 1, got {tokens}")
    if max_tokens < 1:
        raise InvalidInput(f"-n/--max-tokens must be ≥ 1, got {max_tokens}")
    from larql.api import parse_engines
    from larql.harness.memory import default_memory_specs, predict_memory
    from larql.models.structure import load_structure

    specs = parse_engines(engines or default_memory_specs())
    structure = load_structure(model, dtype)
    rows = predict_memory(structure, specs, tokens, max_tokens)
    per_token = structure.config.kv_bytes_per_token(2)
    if output == "json":
        report = {
            "model": structure.name,
            "source": str(structure.source),
            "dtype": str(structure.dtype).removeprefix("torch."),
            "prompt_tokens": tokens,
            "max_tokens": max_tokens,
            "fp16_full_bytes_per_token": per_token,
            "engines": [row.as_json() for row in rows],
        }
        print(json.dumps(report, indent=2))
        return
    title = (
        f"{structure.name} · {str(structure.dtype).removeprefix('torch.')} · a prompt of "
        f"{tokens:,} tokens and {max_tokens:,} new: bytes each engine holds (MiB)"
    )
    stdout.print(memory_table(rows, title, per_token))


def memory_table(rows: list[MemoryPrediction], title: str, per_token: int) -> Unbroken:
    caption = (
        "state = hot + cold + derivative (rebuildable caches); held = state + reserve (capacity "
        "allocated ahead); × fp16 full = state over a full fp16 K/V cache of the same positions "
        f"({per_token:,} B a token). Counted by each engine's own code on torch's meta device, "
        "as larql run's CPU paths hold them (docs/CLI.md, larql memory)."
    )
    table = Table(title=title, caption=caption, caption_justify="left")
    columns = (
        "engine",
        "positions",
        "state",
        "hot",
        "cold",
        "derivative",
        "reserve",
        "held",
        "× fp16 full",
    )
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        if row.memory is None:
            table.add_row(row.spec, Text(row.error or "", style="red"))
            continue
        m = row.memory
        cells: list[Any] = [
            f"{n / 2**20:,.2f}" for n in (m.state, m.hot, m.cold, m.derivative, m.reserved, m.total)
        ]
        ratio = row.ratio_vs_fp16_full
        table.add_row(
            row.spec, f"{row.positions:,}", *cells, "—" if ratio is None else f"{ratio:.3f}"
        )
    # no number or word split at a narrow terminal: the least telling columns go first
    return Unbroken(table, ("held", "derivative", "cold", "hot", "positions"))
