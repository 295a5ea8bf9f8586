"""One layer's decode attention at depth on a GPU: turbo-quant's Triton kernels over the packed
codes against standard's split-key Triton kernel and torch's SDPA over a bf16 cache, at a
Llama-3.2-1B layer's heads (32 query, 8 K/V, width 64) by default. Each is timed as replays of
a captured CUDA graph (`triton.testing.do_bench_cudagraph`, median), with the bytes each reads
and the bandwidth that makes; `--shapes` also times the turbo kernel's launch shapes (splits,
block rows, warps) so its constants are chosen by measurement.

    python benchmarks/turbo_quant_attention.py [--depths 4096,32000] [--bits 4]
        [--shapes 16:256:32:4,...]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch
import torch.nn.functional as F


class _NoLaunch:
    """Stands in for a kernel so a launch can be timed without the other."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def bandwidth(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9  # GB/s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="4096,32000")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument(
        "--levers", action="store_true", help="the catalog's: 4 sinks, 32 recent rows, centered"
    )
    parser.add_argument(
        "--gather",
        action="store_true",
        help="also time the 4-bit codes decoded by tl.gather instead of the PTX lookup",
    )
    parser.add_argument(
        "--shapes",
        default="",
        help="more turbo launch shapes to time, min_splits:max_splits:block:warps, comma-separated",
    )
    parser.add_argument(
        "--sessions",
        type=int,
        default=0,
        help="instead: time one batched launch over this many sessions (each its own store of "
        "the depth), at every split count in --splits",
    )
    parser.add_argument("--splits", default="1,2,4,8,16,32")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    from triton.testing import do_bench_cudagraph

    from larql.kernels.decode_attention import decode_attention
    from larql.kv.turbo_quant import kernels
    from larql.kv.turbo_quant.codec import TurboQuantCodec
    from larql.kv.turbo_quant.layout import ring_slots
    from larql.kv.turbo_quant.planes import from_rows

    hq, hkv, d = args.heads, args.kv_heads, args.dim
    scale = d**-0.5
    codec = TurboQuantCodec(d, args.bits, norm_correction=args.levers)
    tables = kernels.CodecTables.of(codec, torch.device("cuda"))
    defaults = (kernels.MIN_SPLITS, kernels.MAX_SPLITS, kernels.BLOCK_N, kernels.PARTIAL_WARPS)
    if args.sessions:
        for depth in (int(x) for x in args.depths.split(",")):
            time_sessions(kernels, tables, args, depth)
        return
    for depth in (int(x) for x in args.depths.split(",")):
        kw = {"device": "cuda", "dtype": torch.bfloat16}
        capacity = 1 << (depth - 1).bit_length()
        q = torch.randn(hq, 1, d, **kw)
        keys, values = torch.randn(2, hkv, capacity, d, **kw)
        k_new, v_new = torch.randn(2, hkv, 1, d, **kw)
        pos = torch.tensor([depth], device="cuda")
        index = torch.arange(capacity, device="cuda")
        vectors = torch.stack((keys, values)).permute(2, 0, 1, 3).reshape(-1, d)  # token-major
        rows = kernels.encode(vectors, tables).view(capacity, -1)  # [C, row_bytes]
        codes = from_rows(rows, tables.bytes_per_vector)  # the store, by plane

        def sdpa(q=q, keys=keys, values=values, pos=pos, index=index):
            mask = (index <= pos).view(1, -1)
            return F.scaled_dot_product_attention(
                q[None], keys[None], values[None], attn_mask=mask, scale=scale, enable_gqa=True
            )[0]

        def standard(q=q, keys=keys, values=values, pos=pos):
            return decode_attention(q, keys, values, pos, scale)

        cache_bytes = 2 * hkv * depth * d * 2
        code_bytes = depth * codes.shape[1]
        row = {
            "depth": depth,
            "capacity": capacity,
            "heads": [hq, hkv, d],
            "bits": args.bits,
            "levers": args.levers,
        }
        for name, fn, nbytes in (
            ("sdpa", sdpa, cache_bytes),
            ("standard_triton", standard, cache_bytes),
        ):
            us = do_bench_cudagraph(fn, rep=200) * 1e3
            row[f"{name}_us"] = round(us, 2)
            row[f"{name}_GBs"] = round(bandwidth(nbytes, us), 1)
            print(f"  {depth} {name}: {us:.1f} µs", flush=True)
        shapes = [defaults]
        shapes += [
            tuple(int(x) for x in shape.split(":")) for shape in args.shapes.split(",") if shape
        ]
        for low, high, block, warps in shapes:
            kernels.MIN_SPLITS, kernels.MAX_SPLITS = low, high
            kernels.BLOCK_N, kernels.PARTIAL_WARPS = block, warps
            workspace = kernels.Workspace.of(hq, hkv, tables, q.device)
            copy = codes.clone()
            levers = kernels.Levers.none(hkv, tables, q.device)
            if args.levers:
                f32 = {"dtype": torch.float32, "device": "cuda"}
                levers = kernels.Levers(
                    exact=torch.randn(4 + ring_slots(32), 2, hkv, d, **kw),
                    mean=torch.randn(2, hkv, d, **f32),
                    mean_rotated=torch.randn(2, hkv, tables.rotated_dim, **f32),
                    sinks=4,
                    recent=32,
                    center=True,
                )

            variants = [("", tables)]
            if args.gather and tables.lookups:
                variants.append(("_gather", replace(tables, lookups={})))
            for variant, run_tables in variants:
                time_turbo(
                    kernels,
                    row,
                    f"turbo_{low}_{high}_{block}_{warps}{variant}",
                    depth,
                    (
                        q,
                        k_new,
                        v_new,
                        copy,
                        pos,
                        run_tables,
                        scale,
                        0.0,
                        workspace,
                        levers,
                        kernels.single_meta(copy),
                    ),
                    code_bytes,
                )
        print(json.dumps(row), flush=True)


def time_turbo(kernels, row: dict, key: str, depth: int, call: tuple, code_bytes: int) -> None:
    """Both launches, then the partial launch alone; `key` names the splits min/max, rows per
    block and warps (and the decoding variant)."""
    from triton.testing import do_bench_cudagraph

    def turbo():
        return kernels.attention(*call)

    try:
        us = do_bench_cudagraph(turbo, rep=200) * 1e3
        combine = kernels._attention_combine
        kernels._attention_combine = _NoLaunch()  # the partial launch alone
        try:
            partial_us = do_bench_cudagraph(turbo, rep=200) * 1e3
        finally:
            kernels._attention_combine = combine
    except Exception as error:  # a shape that does not compile (registers, smem)
        print(json.dumps({"shape": key, "error": str(error)[:200]}))
        return
    print(f"  {depth} {key}: {us:.1f} µs (partial launch {partial_us:.1f})", flush=True)
    row[f"{key}_us"] = round(us, 2)
    row[f"{key}_partial_us"] = round(partial_us, 2)
    row[f"{key}_GBs"] = round(bandwidth(code_bytes, us), 1)


def time_sessions(kernels, tables, args, depth: int) -> None:
    """One batched launch (`kernels.batched_attention`) over `args.sessions` sessions at
    `depth`, each with its own store (copies of one), at every split count in `args.splits`;
    with the registers and shared memory of the partial launch's compiled kernel."""
    from triton.testing import do_bench_cudagraph

    from larql.kv.turbo_quant.planes import from_rows

    hq, hkv, d, b = args.heads, args.kv_heads, args.dim, args.sessions
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    capacity = 1 << (depth - 1).bit_length()
    keys, values = torch.randn(2, hkv, capacity, d, **kw)
    vectors = torch.stack((keys, values)).permute(2, 0, 1, 3).reshape(-1, d)
    one = from_rows(
        kernels.encode(vectors, tables).view(capacity, -1), tables.bytes_per_vector
    )  # [C, row_bytes], by plane
    del keys, values, vectors
    anchor = torch.zeros(16, dtype=torch.uint8, device="cuda")
    operands = kernels.Operands.anchored(anchor, torch.bfloat16)
    stores, rows = [], []
    for _ in range(b):
        store = one.clone()
        levers = kernels.Levers.none(hkv, tables, store.device)
        levers = replace(levers, exact=levers.exact.to(torch.bfloat16))
        stores.append((store, levers))
        rows.append(operands.offsets(store, levers))
    meta = torch.tensor(rows, device="cuda")
    positions = torch.full((b,), depth, device="cuda")
    q = torch.randn(b, hq, d, **kw)
    k_new, v_new = torch.randn(2, b, hkv, d, **kw)
    workspace = kernels.Workspace.of(hq, hkv, tables, q.device, b)
    template = stores[0][1]
    state_bytes = b * depth * one.shape[1]
    compiled = {}
    launcher = kernels._attention_partial

    class Recording:
        def __getitem__(self, grid):
            def launch(*a, **k):
                compiled["partial"] = launcher[grid](*a, **k)
                return compiled["partial"]

            return launch

    for n in (int(x) for x in args.splits.split(",")):

        def run(n=n):
            return kernels.batched_attention(
                q,
                k_new,
                v_new,
                operands,
                meta,
                positions,
                capacity,
                tables,
                d**-0.5,
                0.0,
                workspace,
                template,
                n,
            )

        kernels._attention_partial = Recording()
        try:
            run()
        finally:
            kernels._attention_partial = launcher
        kernel = compiled["partial"]
        us = do_bench_cudagraph(run, rep=200) * 1e3
        row = {
            "depth": depth,
            "sessions": b,
            "splits": n,
            "us": round(us, 1),
            "us_per_session": round(us / b, 2),
            "GBs": round(bandwidth(state_bytes, us), 1),
            "regs": getattr(kernel, "n_regs", None),
            "spills": getattr(kernel, "n_spills", None),
            "shared": getattr(getattr(kernel, "metadata", None), "shared", None),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
