"""turbo-quant's CUDA partial launch at depth 32,000, per CTA or alone.

The launch (`kv/turbo_quant/partial.cu`) in the engine's own step, on a 1B-shaped model at depth
32,000 (`benchmarks/random_llama_1b.py` makes one), two ways:

- `--trace`: every CTA's start and end (`%globaltimer`, 256 ns a tick on an H200) and, for the
  split CTAs, the cycles of their set-up (the table, the queries rotated), their coded rows and
  their merge (`clock64`), over the 16 launches of one eager decode step. A copy of the source
  with the stamps written in (the kernel's last argument, unused outside the launcher's check,
  carries the buffer).
- otherwise: the launch alone, timed as replays of a CUDA graph of the step's 16 launches with
  their real arguments (4 passes a replay, so the codes come from memory as in a step), for the
  source and each `--source` file given (other versions of the kernel, to compare).

    python benchmarks/turbo_quant_cuda_launch.py MODEL_DIR [--trace] [--source A.cu,B.cu]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from larql.inference.ffn import DenseFfn
from larql.kv import parse_engine
from larql.kv.turbo_quant import cuda_partial
from larql.models import load_model

DEPTH = 32_000
STAMPS = 8  # per CTA: globaltimer start, end, SM, clock at start, set-up done, rows done, end, kind


def traced_source(source: str) -> str:
    """`source` with each CTA's stamps written to the kernel's last argument."""
    edits = [
        (
            "float scale, float scale_log2,\n                            int state_index, float* "
            "m_out, float* l_out, float* acc_out) {",
            "float scale, float scale_log2,\n                            int state_index, float* "
            "m_out, float* l_out, float* acc_out, unsigned long long* tr) {",
        ),
        (
            "  __syncthreads();\n  if (CENTER && warp < G) {",
            "  __syncthreads();\n  if (threadIdx.x == 0) tr[4] = clock64();\n"
            "  if (CENTER && warp < G) {",
        ),
        (
            "  __syncthreads();  // every warp is done with the staged rotation\n",
            "  __syncthreads();  // every warp is done with the staged rotation\n"
            "  if (threadIdx.x == 0) tr[5] = clock64();\n",
        ),
        (
            "  const int head = blockIdx.x, split = blockIdx.y, session = blockIdx.z;\n",
            "  const int head = blockIdx.x, split = blockIdx.y, session = blockIdx.z;\n"
            "  unsigned long long* tr = (unsigned long long*)base_out + 8ull * (((size_t)blockIdx.z"
            " * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x);\n"
            '  if (threadIdx.x == 0) { unsigned long long g0; asm volatile("mov.u64 %0, '
            '%%globaltimer;" : "=l"(g0)); unsigned sm; asm("mov.u32 %0, %%smid;" : '
            '"=r"(sm)); tr[0] = g0; tr[2] = sm; tr[3] = clock64(); tr[7] = split == ns; }\n',
        ),
        (
            "                acc_out);\n    return;\n  }",
            "                acc_out);\n    __syncthreads();\n    if (threadIdx.x == 0) { unsigned "
            'long long g1; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g1)); tr[1] = g1;'
            " tr[6] = clock64(); }\n    return;\n  }",
        ),
        (
            "(float)scale, scale_log2, state_index, m_out, l_out, acc_out);\n}",
            "(float)scale, scale_log2, state_index, m_out, l_out, acc_out, tr);\n"
            "  __syncthreads();\n  if (threadIdx.x == 0) { unsigned long long g1; asm volatile("
            '"mov.u64 %0, %%globaltimer;" : "=l"(g1)); tr[1] = g1; tr[6] = clock64(); }\n}',
        ),
    ]
    for old, new in edits:
        if source.count(old) != 1:
            raise SystemExit(f"the kernel source changed; no single place for: {old[:60]!r}")
        source = source.replace(old, new)
    return source


def launch_with(kernel: object, args: tuple, last: torch.Tensor) -> None:
    """`cuda_partial.launch`'s call with `last` as the kernel's last argument."""
    (
        q,
        rotation,
        k_new,
        v_new,
        codes,
        exact,
        centroids,
        mean_rotated,
        meta,
        positions,
        m,
        l_sum,
        acc,
        n_splits,
        keep,
        scale,
    ) = args
    kernel(  # type: ignore[operator]
        grid=(k_new.shape[1], n_splits + 1, k_new.shape[0]),
        block=(cuda_partial.WARPS * 32, 1, 1),
        args=[
            q,
            rotation,
            k_new,
            v_new,
            codes,
            exact,
            centroids,
            mean_rotated,
            meta,
            positions,
            m,
            l_sum,
            acc,
            n_splits,
            keep,
            float(scale),
            last,
        ],
        shared_mem=cuda_partial.shared_bytes(),
    )


def step_at_depth(model, on_launch: Callable[[tuple], None]) -> None:
    """A turbo-quant engine prefilled to DEPTH tokens, three eager steps, then one more whose
    16 partial launches go to `on_launch` (their arguments, `cuda_partial.launch`'s less the
    kernel) instead."""
    ids = torch.randint(10, 40_000, (DEPTH,), generator=torch.Generator().manual_seed(0)).tolist()
    ffn = DenseFfn(model)
    engine = parse_engine("turbo-quant:graph=0").build(model)
    real = cuda_partial.launch
    with torch.inference_mode():
        engine.prefill(model, ffn, ids)
        for token in ids[:3]:
            engine.decode_step(model, ffn, token)
        cuda_partial.launch = lambda kernel, *args: on_launch(args)
        try:
            engine.decode_step(model, ffn, ids[3])
        finally:
            cuda_partial.launch = real
        torch.cuda.synchronize()


def compiled(source: str) -> object:
    config = next(iter(cuda_partial._compiled))[1]  # the engine's, compiled by its first step
    kernel = torch.cuda._compile_kernel(
        source,
        "turbo_quant_partial",
        nvcc_options=["-std=c++17", "--use_fast_math", *config.defines()],
    )
    kernel.set_shared_memory_config(cuda_partial.shared_bytes())
    return kernel


def trace(model) -> None:
    kernel: list[object] = []
    stamps = torch.zeros((16, 1024, STAMPS), dtype=torch.int64, device="cuda")
    grids: list[int] = []

    def stamped(args: tuple) -> None:
        if not kernel:
            kernel.append(compiled(traced_source(cuda_partial.SOURCE.read_text())))
        launch_with(kernel[0], args, stamps[len(grids)])
        grids.append(args[2].shape[1] * (args[13] + 1) * args[2].shape[0])

    step_at_depth(model, stamped)
    rows = []
    for layer, ctas in enumerate(grids):
        t = stamps[layer, :ctas].double().cpu()
        start = float(t[:, 0].min())
        for cta in t.tolist():
            rows.append(
                [
                    layer,
                    cta[7],
                    cta[2],
                    cta[0] - start,
                    cta[1] - start,
                    cta[4] - cta[3],
                    cta[5] - cta[4],
                    cta[6] - cta[5],
                ]
            )
    table = torch.tensor(rows, dtype=torch.float64)
    quantiles = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64)
    print(f"{len(grids)} launches of {grids[0]} CTAs; quantiles 0 / 10 / 50 / 90 / 100%")
    for kind, name in ((0, "split"), (1, "exact rows")):
        of = table[table[:, 1] == kind]
        print(f"{name} CTAs: start ns {of[:, 3].quantile(quantiles).round().tolist()}")
        print(f"{name} CTAs: end ns   {of[:, 4].quantile(quantiles).round().tolist()}")
        if kind == 0:
            for column, phase in ((5, "set-up"), (6, "coded rows"), (7, "merge")):
                spread = of[:, column].quantile(quantiles).round().tolist()
                print(f"split CTAs: {phase} cycles {spread}")
    for layer in range(len(grids)):
        of = table[table[:, 0] == layer]
        _, per_sm = of[:, 2].unique(return_counts=True)
        print(
            f"layer {layer}: {of[:, 4].max():.0f} ns, SMs {len(per_sm)}, "
            f"{int((per_sm > 1).sum())} with two CTAs"
        )


def timed(model, sources: list[Path]) -> None:
    saved: list[tuple] = []

    def keep(args: tuple) -> None:
        saved.append(
            tuple(
                a.clone() if isinstance(a, torch.Tensor) and a.numel() < 10_000_000 else a
                for a in args
            )
        )

    step_at_depth(model, keep)
    graphs = {}
    distinct = len({p.name for p in sources}) == len(sources)  # else labelled by path
    for path in sources:
        kernel = compiled(path.read_text())
        for args in saved:
            launch_with(kernel, args, args[10])  # (the last argument unread)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(4):
                for args in saved:
                    launch_with(kernel, args, args[10])
        graphs[path.name if distinct else str(path)] = graph
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(4):  # the versions in turn
        for name, graph in graphs.items():
            graph.replay()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(10):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            times[name].append(begin.elapsed_time(end) * 1000 / (10 * 4 * len(saved)))
    for name, us in times.items():
        print(f"{name}: µs a launch {' '.join(f'{x:.2f}' for x in us)} (min {min(us):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a 1B-shaped HF directory (benchmarks/random_llama_1b.py)")
    parser.add_argument("--trace", action="store_true", help="each CTA's times, not the launch's")
    parser.add_argument("--source", default="", help="other kernel sources to time (a,b,...)")
    args = parser.parse_args()
    model = load_model(args.model, dtype=torch.bfloat16, device="cuda")
    if args.trace:
        trace(model)
    else:
        others = [Path(p) for p in args.source.split(",") if p]
        timed(model, [cuda_partial.SOURCE, *others])


if __name__ == "__main__":
    main()
