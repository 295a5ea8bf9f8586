"""`larql boundary ls DIR`: list the frames a `boundary-kv:archive=DIR` run wrote — which chunk
each covers, what the model predicted there and how sure it was, and how the residual is stored.
Reads the archive only; no model is loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from larql.cli.common import stderr, stdout, user_errors
from larql.cli.renamed import output_format

if TYPE_CHECKING:
    from larql.kv.boundary import BoundaryFrame

OUTPUTS = ("text", "json")

boundary_app = typer.Typer(
    help="Inspect boundary-frame archives written by the boundary-kv engine.",
    no_args_is_help=True,
)


def frame_row(frame: BoundaryFrame) -> dict[str, object]:
    meta = frame.metadata
    return {
        "sequence_id": frame.sequence_id,
        "run_id": frame.run_id,
        "boundary_id": frame.boundary_id,
        "token_start": frame.token_start,
        "token_end": frame.token_end,
        "top1_token_id": meta.top1_token_id,
        "top1_text": meta.top1_text,
        "top2_token_id": meta.top2_token_id,
        "raw_logit_margin": meta.raw_logit_margin,
        "raw_log_prob_margin": meta.raw_log_prob_margin,
        "raw_top1_prob": meta.raw_top1_prob,
        "agreement": meta.agreement.value,
        "codec_fragile": meta.codec_fragile,
        "boundary_fragile": meta.boundary_fragile,
        "payload_codec": frame.payload.codec,
        "payload_bytes": frame.payload.nbytes,
        "payload_contract": frame.payload.contract.value,
        "model_id": frame.identity.model_id,
        "model_revision": frame.identity.model_revision,
        "layer": frame.layer,
        "hidden_size": frame.hidden_size,
    }


@boundary_app.command("ls")
@user_errors
def ls(
    directory: Annotated[Path, typer.Argument(help="Archive directory (boundary-kv:archive=DIR).")],
    output: Annotated[str, typer.Option("--output", "-o", help="text or json.")] = "text",
) -> None:
    """List the boundary frames in DIRECTORY, by sequence and token range."""
    output = output_format(output, OUTPUTS)
    from larql.kv.boundary import DirectoryBoundaryArchive

    frames = DirectoryBoundaryArchive(directory).frames()
    rows = [frame_row(f) for f in frames]
    if output == "json":
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        stderr.print(f"no boundary frames in {directory}")
        return
    table = Table(title=f"Boundary frames in {directory} ({len(rows)})")
    columns = ("sequence", "tokens", "top-1", "logit margin", "p(top-1)", "int8", "payload")
    for column in columns:
        table.add_column(column, overflow="fold")
    for r in rows:
        fragile = " (fragile)" if r["boundary_fragile"] else ""
        table.add_row(
            str(r["sequence_id"]),
            f"{r['token_start']}–{r['token_end']}",
            f"{r['top1_token_id']} {r['top1_text']!r}",
            f"{r['raw_logit_margin']:.3f}",
            f"{r['raw_top1_prob']:.3f}{fragile}",
            str(r["agreement"]),
            f"{r['payload_codec']} {r['payload_bytes']} B",
        )
    stdout.print(table)
