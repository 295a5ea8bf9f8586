"""Load-time quantisation (`--weights q8_0|q4_0`): a float model's matrices into GGUF blocks.

Every layer matrix (wq, wk, wv, wo, w_gate, w_up, w_down) and the LM head (the embedding when
tied) whose width is a multiple of 32 is quantised with the `gguf` package's own quantiser into
`BlockRows` under its canonical name; a narrower-blocked matrix stays float. The float weights
are then *replaced* by the blocks' dequantised values, so prefill (BLAS on the floats) and
decode (the block kernels) compute with the same weights, and every exactness relation between
prefill and decode still holds up to float rounding. A state already dequantised from a
quantised GGUF is re-quantised from those floats.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from larql.models.blocks import BLOCK, GGUF_FORMATS, BlockRows

LOAD_FORMATS = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
_LAYER_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def quantised_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The canonical names load-time quantisation covers in `state` (any width)."""
    head = "lm_head" if "lm_head" in state else "embed"
    layers = [n for n in state if n.startswith("layers.") and n.split(".")[-1] in _LAYER_MATRICES]
    return [*layers, head]


def quantise_matrix(weight: torch.Tensor, format: str) -> tuple[BlockRows, torch.Tensor]:
    """weight [out, in] (in a multiple of 32) → (its blocks in `format`, a key of LOAD_FORMATS;
    their dequantised float32 values [out, in], by the `gguf` package: `BlockRows.dequantize`'s
    values, several times faster)."""
    qtype = LOAD_FORMATS[format]
    array = weight.detach().to(torch.float32).cpu().numpy()  # [out, in]
    raw = quantize(np.ascontiguousarray(array), qtype)  # uint8 [out, in/32 · block bytes]
    values = torch.from_numpy(np.ascontiguousarray(dequantize(raw, qtype), dtype=np.float32))
    out_features, in_features = weight.shape
    blocks = BlockRows.from_numpy(GGUF_FORMATS[qtype], raw, (out_features, in_features))
    return blocks, values


def quantise_state(
    state: dict[str, torch.Tensor], format: str
) -> tuple[dict[str, torch.Tensor], dict[str, BlockRows]]:
    """→ (the state with each quantised matrix replaced by its blocks' dequantised float32
    values, the blocks under canonical names). The one place both are made, so they agree."""
    if format not in LOAD_FORMATS:
        raise ValueError(
            f"unknown load-time format {format!r}; accepted: {', '.join(LOAD_FORMATS)}"
        )
    replaced = dict(state)
    blocks: dict[str, BlockRows] = {}
    for name in quantised_names(state):
        weight = state[name]
        if weight.dim() != 2 or weight.shape[1] % BLOCK:
            continue
        blocks[name], replaced[name] = quantise_matrix(weight, format)
    return replaced, blocks
