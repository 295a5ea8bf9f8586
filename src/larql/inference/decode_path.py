"""The decode path that ran, in words: device · dtype · how the weights were read · the kernel
path of the decode steps (`larql.kernels.ran`'s kinds, noted where each path is taken)."""

from __future__ import annotations

from larql.inference.linear import reads_blocks
from larql.kernels.ran import BLOCK_PRODUCTS, FUSED_LAYERS, FUSED_PIECES, step_kinds
from larql.models.model import Model

_READ_BLOCKS = {FUSED_LAYERS, FUSED_PIECES, BLOCK_PRODUCTS}


def decode_path(model: Model, kinds: set[str] | frozenset[str], steps: int) -> str:
    """e.g. `cpu · float32 · weights in GGUF blocks · fused C++ layers` for `steps` decode steps
    that noted `kinds`."""
    dtype = str(model.dtype).removeprefix("torch.")
    if steps == 0:
        return f"{model.device.type} · {dtype} · no decode step ran (one token)"
    blocks = reads_blocks(model) and bool(_READ_BLOCKS & set(kinds))
    weights = "weights in GGUF blocks" if blocks else "weights dequantised"
    return f"{model.device.type} · {dtype} · {weights} · {step_kinds(set(kinds))}"
