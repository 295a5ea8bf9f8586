"""Quantised rows encoded on the CPU by the compiled extension (each codec's
`compiled_encode`: turbo-quant's `coded_encode`, kv-quant's `grouped_encode`), and whether a
turbo-quant layer's codes are: a float32 model on the CPU with the extension built, and
`TurboQuantCodec` codes of one codec for K and V (2, 3 or 4 bits, a rotated width of whole
bytes). The arithmetic is the torch codec's in another order of float sums, so a coordinate
within rounding of a cell boundary may take the neighbouring cell; everything else is the
codec's bytes.
"""

from __future__ import annotations

import torch

from larql.kernels.cpu import cpu_extension
from larql.kv.turbo_quant.codec import RowCodec, TurboQuantCodec
from larql.models.model import Model


def compiled_codes(model: Model, k_codec: RowCodec, v_codec: RowCodec) -> bool:
    """Whether a layer of `model` with these codecs is encoded and attended by the extension
    (the engine asks only for its rotated-basis attention, not for `attention=sdpa`)."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return False
    if not isinstance(k_codec, TurboQuantCodec) or v_codec is not k_codec:
        return False
    if k_codec.rotated_dim % 8:  # whole bytes per 8 indices at every width (2, 3 or 4 bits)
        return False
    return cpu_extension() is not None


def encode_rows(codec: RowCodec, rows: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
    """rows [S, 2, Hkv, D] (float32 or float16) minus `mean` [2, Hkv, D] → one code row per
    token, uint8 [S, row_bytes] ([K heads ; V heads]), by the codec's compiled encoding
    (`compiled_encode`; the torch codec where the extension is not built)."""
    kernels = cpu_extension()
    if kernels is None:
        s = rows.shape[0]
        x = rows.float() if mean is None else rows.float() - mean
        return codec.encode(x.reshape(-1, rows.shape[-1])).view(s, -1)
    return codec.compiled_encode(kernels, rows, mean)  # type: ignore[attr-defined]


_EMPTY = torch.empty(0)


def or_empty(mean: torch.Tensor | None) -> torch.Tensor:
    """The mean rows, or the empty tensor that tells the extension there are none."""
    return _EMPTY if mean is None else mean
