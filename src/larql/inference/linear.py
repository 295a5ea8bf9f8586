"""`linear`: `F.linear`, except for the one-row products of a decode step on the CPU.

MKL runs a one-row float32/float64 product (a GEMV) on a single core: 16 GB/s on the project's
2-core machine, where the memory system delivers ~38 GB/s to two cores (the float16 GEMV gets
there). Split into a batched product over one row group per thread, MKL runs one group per core:
SmolLM2's 30 layers go from 26 to 11 ms per token in float32 (benchmarks in
docs/PERFORMANCE.md). bfloat16/float16 and everything on a GPU keep `F.linear`, which is
already fast there.

A matrix the model also holds in its GGUF blocks (`BlockRows`: Q8_0 / Q4_0 / Q4_1, Q4_K
repacked) is read from those instead, on the CPU, by the compiled block product
(`larql.kernels.cpu`): a Q4_1 row is 0.16× the bytes of its float32 one. So are products of a
few rows (up to `block_rows(activation)`: a batched decode step, a prompt), each weight read
once for all of them and each row computed exactly as alone; past that, BLAS on the float
matrix is faster. Without the built extension, torch's float product runs as before.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import torch
import torch.nn.functional as F

from larql.kernels.cpu import cpu_extension
from larql.kernels.ran import BLOCK_PRODUCTS, ran
from larql.models.blocks import ACTIVATION_BITS, FORMAT_CODES, BlockRows
from larql.models.model import Model

_SPLIT_DTYPES = (torch.float32, torch.float64)
# rows up to which the block product beats BLAS on the float matrix: with the AVX2 products
# (SmolLM2's gate/up on a 2-core machine: 0.29 against 0.42 ms at 8 rows, 0.53 / 0.66 at 16,
# 1.35 / 1.04 at 32) and in the tiled products of int16 inputs — on AMX tiles (a whole prefill
# of the default model on a 2-core Xeon: 24 tokens 22.5 against 61 ms, 64: 51 / 94, 128: 111 /
# 143, 256: 240 / 263) and with AVX-512 VNNI (SmolLM2's gate/up on the 2-core Zen 4: 0.20
# against 0.62 ms at 16 rows, 0.73 / 1.98 at 64, 3.02 / 6.80 at 256). int8 inputs take the
# same tiles with half the byte products, so the same limit holds for them.
BLOCK_ROWS = 16
TILED_BLOCK_ROWS = 256
_TILED_ACTIVATIONS = ("int8", "int16")  # the inputs the tiled products take


@cache
def _tiled() -> bool:
    kernels = cpu_extension()
    return kernels is not None and kernels.tiled()


def block_rows(activation: str) -> int:
    """Rows up to which a product of blocks that take `activation` inputs (and the compiled
    layer over them) reads the GGUF blocks rather than the float matrix: `TILED_BLOCK_ROWS`
    for integer inputs where the tiled products run (AVX-512 VNNI or AMX), else `BLOCK_ROWS`."""
    return TILED_BLOCK_ROWS if activation in _TILED_ACTIVATIONS and _tiled() else BLOCK_ROWS


def model_block_rows(model: Model) -> int:
    """`block_rows` for the inputs `model`'s block matrices take (`BLOCK_ROWS` without any)."""
    layer_blocks = model.weights.layers[0].blocks if model.weights.layers else {}
    first = next(iter(layer_blocks.values()), None)
    return BLOCK_ROWS if first is None else block_rows(first.activation)


_TILED_CODE = 16  # the extension's format code of a tiled matrix: 16 + its format's


def kernel_rows(blocks: BlockRows, kernels: ModuleType) -> tuple[torch.Tensor, int]:
    """The extension's (rows, format) arguments for `blocks`. On a CPU with AVX-512 VNNI (AMX
    too, or not) a block matrix of integer-input products (whole tiles of 16 rows) is
    rearranged into the tiles' order at its first product, in place (`BlockRows.tiled`: the
    same bytes, so no second copy), and is then read tiled with the tiled format code by every
    product, one row or many."""
    code = FORMAT_CODES[blocks.format]
    if blocks.tiled:
        return blocks.data, code + _TILED_CODE
    tileable = blocks.activation in _TILED_ACTIVATIONS and blocks.out_features % 16 == 0
    if tileable and kernels.tiled():
        blocks.data, blocks.tiled = kernels.tile_rows(blocks.data, code), True
        return blocks.data, code + _TILED_CODE
    return blocks.data, code


def reads_blocks(model: Model) -> bool:
    """Whether `model`'s one-token products read its block matrices (it has some, on the CPU,
    below float64, and the kernels are built)."""
    return (
        model.weights.block_bytes > 0
        and model.device.type == "cpu"
        and model.dtype != torch.float64
        and cpu_extension() is not None
    )


def rows_per_pass(model: Model) -> int | None:
    """Input rows the block products take in one pass over a weight matrix, where `model`'s
    products read its blocks: 16 in the tiled products (AVX-512 VNNI or AMX), 8 in the AVX2
    products' input tiles. A product
    of one row more than a whole number of passes costs a whole pass more (on the default
    model, 8 decode rows and 8 prompt rows took 14.1 ms, one row more 19.7). None: the
    products cost by the row."""
    kernels = cpu_extension() if reads_blocks(model) else None
    if kernels is None:
        return None
    return 16 if kernels.tiled() else 8


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    blocks: BlockRows | None = None,
) -> torch.Tensor:
    """x: [S, in] @ weight[out, in]ᵀ (+ bias) → [S, out]; `blocks`: the same matrix in GGUF
    blocks, which a one-row product on the CPU reads instead."""
    limit = BLOCK_ROWS if blocks is None else block_rows(blocks.activation)
    if torch.compiler.is_compiling() or x.device.type != "cpu" or x.shape[0] > limit:
        # decided before asking for the thread count, which torch.compile cannot trace: a
        # compiled step must not break its graph here (a compiler fuses the product itself)
        return F.linear(x, weight, bias)
    if blocks is not None and x.dtype != torch.float64 and (kernels := cpu_extension()):
        # float64 is the precision reference: it keeps the float product
        rows = x.to(torch.float32).contiguous()  # [S, in]
        data, code = kernel_rows(blocks, kernels)
        bits = ACTIVATION_BITS[blocks.activation]
        ran(BLOCK_PRODUCTS)
        out = kernels.block_gemm(rows, data, code, bits).to(x.dtype)  # [S, out]
        return out if bias is None else out + bias
    if x.shape[0] != 1:
        return F.linear(x, weight, bias)
    groups = torch.get_num_threads()  # row groups: one per thread
    out_features, in_features = weight.shape
    if (
        not x.is_contiguous()
        or groups < 2
        or weight.dtype not in _SPLIT_DTYPES
        or out_features % groups
        or not weight.is_contiguous()
    ):
        return F.linear(x, weight, bias)
    stacked = weight.view(groups, out_features // groups, in_features)  # [G, out/G, in]
    # x.t() keeps a BLAS-compatible leading dimension; a [in, 1] reshape (strides 1, 1) sends
    # bmm to a slow non-BLAS loop (10x).
    column = x.t().expand(groups, in_features, 1)  # [G, in, 1]
    out = torch.bmm(stacked, column).view(1, out_features)  # [1, out]
    return out if bias is None else out + bias
