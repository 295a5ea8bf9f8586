"""A CUDA C++ prototype of turbo-quant's split partial launch (benchmarks/turbo_quant_partial.cu):
checked against a torch decode of the same codes, and timed at depth as replays of a captured
CUDA graph, like `benchmarks/turbo_quant_attention.py` times the Triton launches (run both in
one job to compare). Needs a CUDA device and CuPy (it compiles the kernel with NVRTC).

    python benchmarks/turbo_quant_cuda_partial.py [--depths 4096,32000,31999]
        [--variants 8:256:2:2:1,8:256:2:2:0]

A variant is warps:rows_per_warp:min_blocks:chunks:split — the CTA's warps, the coded rows each
warp walks, the CTAs an SM must fit (`__launch_bounds__`), 16-row chunks per load group, and the
layout (1: the norms apart from the codes; 0: the engine's store as it is).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

HKV, GROUP_HEADS, D = 8, 4, 64  # the 1B shape: 32 query heads over 8 K/V heads, width 64
LUT_BASE = 1024  # the kernel's table address in shared memory, compiled in as an immediate
SOURCE = Path(__file__).with_name("turbo_quant_partial.cu")


def build(cp, warps: int, rows: int, min_blocks: int, chunks: int, split: int):
    module = cp.RawModule(
        code=SOURCE.read_text(),
        options=(
            "-std=c++17",
            "--use_fast_math",
            f"-DW={warps}",
            f"-DRPW={rows}",
            f"-DMINB={min_blocks}",
            f"-DHKV={HKV}",
            f"-DG={GROUP_HEADS}",
            f"-DCH={chunks}",
            f"-DSPLIT={split}",
            f"-DLUT_BASE={LUT_BASE}",
        ),
    )
    kernel = module.get_function("tq_partial")
    smem = 65536 + warps * 8 * 4 * 2 + warps * 8 * D * 4  # the table, then the warps' states
    kernel.max_dynamic_shared_size_bytes = smem
    return kernel, smem


def reference(codes: torch.Tensor, centroids: torch.Tensor, q_rot: torch.Tensor, n: int):
    """Attention over the first n coded rows, decoded in torch (float64) → [Hkv, G, D]."""
    vectors = codes[:n].view(n, 2, HKV, 36)
    norms = vectors[..., :4].contiguous().view(torch.float32)[..., 0].double()  # [n, 2, Hkv]
    packed = vectors[..., 4:].long()
    index = torch.stack((packed & 15, packed >> 4), -1).reshape(n, 2, HKV, D)
    decoded = centroids.to(torch.bfloat16).double()[index] * norms[..., None]
    keys, values = decoded[:, 0], decoded[:, 1]  # [n, Hkv, D]
    q = q_rot.to(torch.bfloat16).double().view(HKV, GROUP_HEADS, D)
    p = (torch.einsum("hgd,nhd->hgn", q, keys) * D**-0.5).softmax(-1)
    return torch.einsum("hgn,nhd->hgd", p, values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="4096,32000,31999")
    parser.add_argument("--variants", default="8:256:2:2:1,8:256:2:2:0")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    try:
        import cupy as cp
    except ImportError as error:
        raise SystemExit(f"needs CuPy to compile the kernel ({error})") from error
    from triton.testing import do_bench_cudagraph

    from larql.kv.turbo_quant import kernels
    from larql.kv.turbo_quant.codec import TurboQuantCodec

    codec = TurboQuantCodec(D, 4, norm_correction=True)
    tables = kernels.CodecTables.of(codec, torch.device("cuda"))
    variants = [tuple(int(x) for x in v.split(":")) for v in args.variants.split(",")]
    for depth in (int(x) for x in args.depths.split(",")):
        capacity = 1 << (depth - 1).bit_length()
        kv = torch.randn(2, HKV, capacity, D, device="cuda", dtype=torch.bfloat16)
        vectors = torch.stack((kv[0], kv[1])).permute(2, 0, 1, 3).reshape(-1, D)  # token-major
        codes = kernels.encode(vectors, tables).view(capacity, -1)  # [C, 2·Hkv·36]
        apart = codes.view(capacity, 2, HKV, 36)
        split_codes = apart[..., 4:].contiguous().view(capacity, -1)  # [C, 2·Hkv·32]
        split_norms = apart[..., :4].contiguous().view(torch.float32)[..., 0]
        split_norms = split_norms.permute(1, 2, 0).contiguous()  # [2, Hkv, C]
        q_rot = torch.randn(HKV * GROUP_HEADS, D, device="cuda") * 2
        want = reference(codes, tables.centroids, q_rot, depth)
        for warps, rows, min_blocks, chunks, split in variants:
            kernel, smem = build(cp, warps, rows, min_blocks, chunks, split)
            splits = -(-depth // (warps * rows))
            m = torch.empty(HKV, splits, GROUP_HEADS, device="cuda")
            l_sum = torch.empty_like(m)
            acc = torch.empty(HKV, splits, GROUP_HEADS, D, device="cuda")
            base = torch.zeros(1, dtype=torch.int32, device="cuda")
            operands = (
                cp.asarray(split_codes if split else codes),
                cp.asarray(q_rot),
                cp.asarray(tables.centroids),
                cp.int32(depth),
                cp.float32(D**-0.5 * math.log2(math.e)),
                cp.asarray(m),
                cp.asarray(l_sum),
                cp.asarray(acc),
                cp.int32(splits),
                cp.asarray(base),
                cp.asarray(split_norms),
                cp.int32(capacity),
            )

            def launch(kernel=kernel, splits=splits, warps=warps, operands=operands, smem=smem):
                with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                    kernel((HKV, splits), (warps * 32,), operands, shared_mem=smem)

            launch()
            torch.cuda.synchronize()
            if int(base.item()) != LUT_BASE:
                raise SystemExit(f"the table sits at {int(base.item())}, not {LUT_BASE}")
            top = m.max(1, keepdim=True).values
            weight = torch.exp(m - top)
            got = (weight[..., None] * acc).sum(1) / (weight * l_sum).sum(1)[..., None]
            row = {
                "depth": depth,
                "variant": [warps, rows, min_blocks, chunks, split],
                "splits": splits,
                "registers": kernel.attributes["num_regs"],
                "max_abs_err": (got.double() - want).abs().max().item(),
                "max_abs_out": want.abs().max().item(),
            }
            if depth % 2 == 0:  # an odd depth checks the tail rows only
                us = do_bench_cudagraph(launch, rep=200) * 1e3
                row["us"] = round(us, 2)
                row["GBs"] = round(depth * codes.shape[1] / (us * 1e-6) / 1e9, 1)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
