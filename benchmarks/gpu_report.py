"""Every engine on CUDA: correctness against the CPU and speed against HF transformers, in one
run (made for one lent GPU; prints a table last and writes JSON).

    python benchmarks/gpu_report.py [--model smollm2-135m] [--prompt 512] [--new 128]
        [--depth 8128] [--skip-compile] [--out DIR]

Checks, per engine, in float32 and bfloat16:
- prefill logits vs the CPU float32 run of the same engine: ‖Δ‖/‖ref‖ (METHOD: float32 far
  under 1e-3, bf16 between 1e-3 and 1e-2);
- greedy tokens over 64 steps vs CPU `standard` (agreement reported);
- exact engines vs GPU `standard`: identical greedy tokens, teacher-forced logits error.
Times (bfloat16, batch 1; engines interleaved over rounds, see `time_engines`): standard fast
path (static cache + CUDA graph) and eager, every other engine, HF `generate` eager
(DynamicCache) and with its static cache (compiled where transformers does so): tok/s, ms/token
p50, achieved bandwidth vs the measured copy bandwidth, peak working memory (the allocator's
peak above what was resident: weights left out), ratio to standard eager.
Then the per-step cost at a deep context, standard vs the windowed engines.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import torch

from larql.data import default_text
from larql.harness.bench.engine_bench import BenchSettings, bench_engines
from larql.harness.bench.hf_peer import bench_hf, load_hf_model
from larql.harness.bench.machine import copy_bandwidth_gbs, peak_above_resident
from larql.harness.contexts import context_ids
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate, teacher_forced_logits
from larql.kv import CATALOG, parse_engine
from larql.models import load_model

EXACT = [
    "no-cache",
    "markov-rs",
    "markov-rs:window=16",
    "markov-rs-codec",
    "boundary-kv:chunk_tokens=16",
    "boundary-per-layer",
    "windowed-checkpoint:window=512",
    "standard:graph=0",
]
CHECK_SPECS = [
    "standard",
    "standard:graph=0",
    "standard:window=64",
    "no-cache",
    "markov-rs",
    "markov-rs:window=16",
    "markov-rs-codec:window=16",
    "windowed-checkpoint:window=64",
    "turbo-quant:bits=4",
    "turbo-quant:bits=3",
    "turbo-quant:bits=2",
    "boundary-kv:chunk_tokens=16",
    "boundary-per-layer:window=16",
]
SPEED_SPECS = [
    "standard:compile=1",
    "standard:compile=1,attention=triton",
    "standard",
    "standard:attention=sdpa",
    "standard:graph=0",
    "markov-rs",
    "markov-rs:window=256",
    "markov-rs-codec:window=256",
    "windowed-checkpoint:window=256",
    "turbo-quant:bits=4",
    "turbo-quant:bits=3",
    "turbo-quant:bits=4,graph=0",
    "turbo-quant:bits=4,attention=sdpa",
    "boundary-kv:chunk_tokens=128",
    "boundary-per-layer:window=256",
    "standard:window=256",
    "no-cache",
]
DEPTH_SPECS = [
    "standard:compile=1",
    "standard",
    "standard:graph=0",
    "standard:window=512",
    "markov-rs:window=512",
    "markov-rs-codec:window=512",
    "windowed-checkpoint:window=512",
    "turbo-quant:bits=4",
    "turbo-quant:bits=4,graph=0",
    "turbo-quant:bits=4,attention=sdpa",
]
PROMPT = "The capital of France is"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def greedy(model, spec: str, ids: list[int], n: int) -> list[int]:
    engine = parse_engine(spec).build(model)
    return generate(engine, model, DenseFfn(model), ids, n, stop_ids=frozenset()).tokens


def prefill_logits(model, spec: str, ids: list[int]) -> torch.Tensor:
    engine = parse_engine(spec).build(model)
    return teacher_forced_logits(engine, model, DenseFfn(model), ids, len(ids))[0]


def check_correctness(cpu, gpus: dict, log: list[str]) -> list[dict]:
    ids = cpu.tokenizer.encode(PROMPT)
    long_ids = context_ids(cpu, 96, default_text())
    ref_tokens = greedy(cpu, "standard", ids, 64)
    ref_prefill = {spec: prefill_logits(cpu, spec, long_ids) for spec in CHECK_SPECS}
    rows = []
    for dtype_name, gpu in gpus.items():
        gpu_standard = greedy(gpu, "standard:graph=0", ids, 64)
        for spec in CHECK_SPECS:
            row = {"dtype": dtype_name, "spec": spec}
            try:
                row["prefill_rel_err"] = rel(prefill_logits(gpu, spec, long_ids), ref_prefill[spec])
                tokens = greedy(gpu, spec, ids, 64)
                row["agree_cpu_standard"] = (
                    sum(a == b for a, b in zip(tokens, ref_tokens, strict=True)) / 64
                )
                if spec in EXACT or spec == "standard":
                    row["exact_vs_gpu_standard"] = tokens == gpu_standard
                    forced = teacher_forced_logits(
                        parse_engine(spec).build(gpu), gpu, DenseFfn(gpu), long_ids, 64
                    )
                    base = teacher_forced_logits(
                        parse_engine("standard:graph=0").build(gpu),
                        gpu,
                        DenseFfn(gpu),
                        long_ids,
                        64,
                    )
                    row["teacher_forced_rel_err"] = rel(forced, base)
            except Exception as e:  # a failing engine is a finding, not a crash of the report
                row["error"] = f"{type(e).__name__}: {e}"
                log.append(traceback.format_exc())
            rows.append(row)
            print("check", json.dumps(row), flush=True)
    return rows


REFERENCE = "standard:graph=0"  # the eager engine the cached engines are compared with


def time_engines(
    gpu, specs: list[str], ids: list[int], new: int, bandwidth: float, rounds: int = 3
) -> list[dict]:
    """Every engine once per round (`bench_engines`): the lent host's eager speed drifts between
    passes (5-10x over minutes), and engines timed back to back each in their own stretch of it
    made ratios of that drift. Where the reference ran, `ratio_vs_reference` is the median over
    rounds of an engine's tok/s over the reference's in the same round."""
    # An untimed pass first: the first use of each kernel in a process loads it (CUDA lazy
    # loading) and the host ramps up; without it the first engines timed ran 5-10x slow.
    kinds = [parse_engine(spec) for spec in specs]
    bench_engines(gpu, DenseFfn(gpu), kinds, ids, BenchSettings(16, 2, 1), len(ids))
    settings = BenchSettings(new_tokens=new, warmup=5, repeats=rounds)
    rows = [
        row.as_dict()
        for row in bench_engines(gpu, DenseFfn(gpu), kinds, ids, settings, len(ids), bandwidth)
    ]
    reference = next(
        (row for row, spec in zip(rows, specs, strict=True) if spec == REFERENCE), None
    )
    for row in rows:
        if reference is not None and row["tok_s_runs"] and reference["tok_s_runs"]:
            ratios = sorted(
                ours / theirs
                for ours, theirs in zip(row["tok_s_runs"], reference["tok_s_runs"], strict=False)
                if theirs
            )
            row["ratio_vs_reference"] = ratios[len(ratios) // 2] if ratios else None
        print("time", row["spec"], row["tok_s"], row["tok_s_runs"], row["error"], flush=True)
    return rows


def time_hf(gpu, ids: list[int], new: int, caches: list[str | None]) -> list[dict]:
    rows: list[dict] = []
    if not caches:
        return rows
    hf = load_hf_model(gpu)
    for cache in caches:
        warmups = 3 if cache == "static" else 1
        try:
            t0 = time.perf_counter()
            with peak_above_resident(gpu.device) as peak:
                peer = bench_hf(hf, ids, new, 3, cache_implementation=cache, warmups=warmups)
            d = peer.as_dict()
            d["setup_s"] = time.perf_counter() - t0
            d["peak_working_bytes"] = peak.bytes
        except Exception as e:
            d = {"label": f"hf {cache}", "error": f"{type(e).__name__}: {e}"}
        rows.append(d)
        print("hf", json.dumps(d), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--depth", type=int, default=8128)
    parser.add_argument(
        "--sections",
        default="checks,speed,hf,hf-static,depth",
        help="any of checks, speed, hf, hf-static, depth (comma-separated)",
    )
    parser.add_argument("--specs", help="override the speed/depth engine lists (;-separated)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    args = parser.parse_args()

    log: list[str] = []
    on_gpu = args.device == "cuda"
    name = torch.cuda.get_device_name() if on_gpu else "cpu (dry run)"
    report: dict = {"gpu": name, "torch": torch.__version__}
    report["copy_bandwidth_gbs"] = bandwidth = copy_bandwidth_gbs(
        args.device, nbytes=(2 << 30) if on_gpu else (64 << 20)
    )
    print(f"{report['gpu']} torch {torch.__version__} copy {bandwidth:.0f} GB/s", flush=True)
    cpu = load_model(args.model, dtype=torch.float32)
    gpus = {
        "float32": load_model(args.model, dtype=torch.float32, device=args.device),
        "bfloat16": load_model(args.model, dtype=torch.bfloat16, device=args.device),
    }
    sections = set(args.sections.split(","))
    chosen = args.specs.split(";") if args.specs else None
    if "checks" in sections:
        report["checks"] = check_correctness(cpu, gpus, log)
    bf16 = gpus["bfloat16"]
    ids = context_ids(bf16, args.prompt, default_text())
    if "speed" in sections:
        specs = [s for s in chosen or SPEED_SPECS if CATALOG.parses(s)]
        report["speed"] = time_engines(bf16, specs, ids, args.new, bandwidth)
    caches = [c for c, name in ((None, "hf"), ("static", "hf-static")) if name in sections]
    report["hf"] = time_hf(bf16, ids, args.new, caches)
    if "depth" in sections:
        deep = context_ids(bf16, args.depth, default_text())
        report["depth"] = time_engines(bf16, chosen or DEPTH_SPECS, deep, 32, bandwidth)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_report.json").write_text(json.dumps(report, indent=2))
    (out / "gpu_report.log").write_text("\n".join(log))
    summarize(report)


def summarize(report: dict) -> None:
    print(f"\n== {report['gpu']}  copy bandwidth {report['copy_bandwidth_gbs']:.0f} GB/s ==")
    for row in report.get("checks", []):
        prefill = row.get("prefill_rel_err", float("nan"))
        agree = row.get("agree_cpu_standard", float("nan"))
        exact = row.get("exact_vs_gpu_standard", "-")
        forced = row.get("teacher_forced_rel_err", float("nan"))
        print(
            f"check {row['dtype']:<8} {row['spec']:<32} prefill {prefill:.2e} agree {agree:.2f} "
            f"exact {exact} tf {forced:.1e} {row.get('error', '')}"
        )
    hf_eager = next(
        (r["tok_s"] for r in report["hf"] if "DynamicCache" in r.get("label", "")), None
    )
    for section in ("speed", "depth"):
        print(f"-- {section} (bf16) --")
        for r in report.get(section, []):
            ratio = f"{r['tok_s'] / hf_eager:.2f}x HF" if hf_eager and r["tok_s"] else ""
            if r.get("ratio_vs_reference"):
                ratio += f" {r['ratio_vs_reference']:.2f}x {REFERENCE}"
            ms = (r["decode_ms"] or {}).get("p50", 0)
            print(
                f"{r['spec']:<34} ctx {r['prompt_tokens']:>5} {r['tok_s'] or 0:8.1f} tok/s "
                f"p50 {ms:7.3f} ms  {r['achieved_gbs'] or 0:7.1f} GB/s "
                f"peak+ {(r['peak_working_bytes'] or 0) / 2**20:7.1f} MiB "
                f"{ratio} {r['error'] or ''}"
            )
    for r in report["hf"]:
        peak = (r.get("peak_working_bytes") or 0) / 2**20
        print(
            f"{r.get('label')}: {r.get('tok_s', 0) or 0:.1f} tok/s peak+ {peak:.1f} MiB "
            f"{r.get('error', '')}"
        )


if __name__ == "__main__":
    main()
