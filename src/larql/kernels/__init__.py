"""Generic Triton kernels for the CUDA decode step (one query row per step): `decode_attention`
for the static-cache fast path of `standard`, and `online_softmax`, the device functions every
attention kernel shares (turbo-quant's, which reads its codec's bytes, lives beside the codec in
`larql.kv.turbo_quant.kernels`); `elementwise`, RoPE, SiLU · up and a 16-bit RMS norm in one
launch each; `gemv`, a decode row's products with the norm, SiLU · up or residual add beside
them folded in; `argmax`, the greedy pick of a few rows of logits; `dependent_launch`, how all
of them are launched on compute capability 9.0 and later (each scheduled while the previous
launch finishes, waiting for its writes).

Triton comes with torch's CUDA builds; a CPU install may have none, and nothing imports these
modules unless `triton_available` says they run. Each kernel has a torch path it replaces
(`attend_static` in `larql.inference.layer`), kept as the reference the tests compare it with and
selectable with `attention=sdpa`.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from types import ModuleType

import torch

from larql.kernels.ran import TRITON, ran

DecodeAttention = Callable[..., torch.Tensor]  # as `decode_attention.decode_attention`


def triton_available(device: torch.device) -> bool:
    """True when the Triton kernels run on `device`: a CUDA device, with Triton installed.
    (The tests also run them on the CPU, in Triton's interpreter.)"""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def decode_attention_kernel(device: torch.device) -> DecodeAttention | None:
    """The split-key decode attention to call on `device` (None where Triton does not run): on
    CUDA the custom op torch.compile can trace, elsewhere the plain launcher. Resolved outside a
    compiled step, since importing inside one breaks its graph."""
    if not triton_available(device):
        return None
    from larql.kernels import decode_attention as module

    ran(TRITON)
    return module.decode_attention_op if device.type == "cuda" else module.decode_attention


def batched_decode_attention_kernel(device: torch.device) -> DecodeAttention | None:
    """Decode attention for many sessions' rows in one step, each over its own static cache
    (`batched_decode_attention`), where Triton runs on `device`; None elsewhere."""
    if not triton_available(device):
        return None
    from larql.kernels.batched_decode_attention import batched_decode_attention

    ran(TRITON)
    return batched_decode_attention


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def elementwise_kernels(x: torch.Tensor) -> ModuleType | None:
    """The one-launch RoPE, SiLU · up, 16-bit RMS norm and K/V row store
    (`larql.kernels.elementwise`) for a tensor on CUDA with Triton installed, outside
    torch.compile (which fuses these itself), in 32 bits or fewer (they compute in float32;
    float64 is the precision reference and keeps torch's ops); None elsewhere."""
    if (
        x.device.type != "cuda"
        or x.dtype == torch.float64
        or not _triton_installed()
        or torch.compiler.is_compiling()
    ):
        return None
    from larql.kernels import elementwise

    ran(TRITON)
    return elementwise


_GEMV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def gemv_kernels(x: torch.Tensor, weight: torch.Tensor) -> ModuleType | None:
    """The one-row products with their neighbours folded in (`larql.kernels.gemv`) for one row
    x: [1, K] on CUDA against a contiguous weight [N, K] of its dtype (32 bits or fewer), with
    Triton installed, outside torch.compile (which fuses the small launches itself); None
    elsewhere, where the caller runs torch's operators."""
    if (
        x.device.type != "cuda"
        or x.dim() != 2
        or x.shape[0] != 1
        or x.dtype not in _GEMV_DTYPES
        or weight.dtype != x.dtype
        or not weight.is_contiguous()
        or not _triton_installed()
        or torch.compiler.is_compiling()
    ):
        return None
    from larql.kernels import gemv

    ran(TRITON)
    return gemv


def argmax_kernel(logits: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Each row's argmax in two short launches (`larql.kernels.argmax`) for float logits
    [B, V] (V ≥ 1, 32 bits or fewer) on CUDA with Triton installed, outside torch.compile;
    None elsewhere, where torch's (or numpy's) argmax runs."""
    if (
        logits.device.type != "cuda"
        or logits.dim() != 2
        or logits.shape[1] == 0
        or logits.dtype not in _GEMV_DTYPES
        or not _triton_installed()
        or torch.compiler.is_compiling()
    ):
        return None
    from larql.kernels.argmax import argmax_rows

    return argmax_rows
