"""The options every model-loading command declares the same way: `-m/--model`, `--device`,
`--dtype`, `--weights`, `--threads`, and the layer ranges (`--layers A-B`) of walk and serve.
Only typer here: `larql --help` must not import torch."""

from __future__ import annotations

from typing import Annotated

import typer

from larql.errors import InvalidInput

ModelOption = Annotated[
    str | None,
    typer.Option(
        "-m", "--model", help="Registry name (larql models), a .gguf file or an HF directory."
    ),
]
DeviceOption = Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N.")]
DtypeOption = Annotated[str, typer.Option("--dtype", help="float32, bfloat16, float16 or float64.")]
WeightsOption = Annotated[
    str,
    typer.Option(
        "--weights",
        help="auto (= blocks-int16): a GGUF's Q8_0/Q4_0/Q4_1/Q4_K matrices stay in their blocks "
        "for one-token products on the CPU (kernels built by make setup), the input rounded to "
        "int16 codes per block of 32; blocks-int8: int8 codes (llama.cpp's, faster, less exact); "
        "blocks-float: a float32 input (the float path's tokens); float: every matrix "
        "dequantised to --dtype; q8_0 / q4_0: quantise every layer matrix and the LM head of "
        "any model (HF, F16/F32 or quantised GGUF, re-quantised from its dequantised floats) to "
        "that GGUF format at load (~2 s for SmolLM2), the float weights replaced by the "
        "quantised values, read as blocks-int16 reads a GGUF's.",
    ),
]
ThreadsOption = Annotated[
    int | None, typer.Option("--threads", help="Torch CPU threads (default: torch's).")
]


def parse_layer_range(text: str, option: str = "--layers") -> tuple[int, int]:
    """`A-B` (inclusive, A ≤ B) or a single one `A` → (A, B)."""
    first, dash, last = text.strip().partition("-")
    try:
        start = int(first)
        end = int(last) if dash else start
    except ValueError:
        raise InvalidInput(f"{option} must be A-B (e.g. 0-15), got {text!r}") from None
    if start < 0 or end < start:
        raise InvalidInput(f"{option} must be A-B with 0 ≤ A ≤ B, got {text!r}")
    return start, end
