"""larql `standard` against HF transformers `generate` (DynamicCache) in one run: same GGUF
weights (transformers dequantizes them itself), same dtype, same threads, same prompt and token
count. Prints prefill ms and decode tok/s of each and the ratio.

    .venv/bin/python benchmarks/decode_vs_hf.py [--prompt-tokens 256] [--new-tokens 64]
        [--repeats 3] [--threads 2] [--dtype float32] [--engine standard] [--json]

It is `larql bench --vs-hf` reduced to one engine and one line of output per peer.
"""

from __future__ import annotations

import argparse
import json

import torch

from larql.data import default_text
from larql.harness.bench.engine_bench import BenchSettings, bench_engine
from larql.harness.bench.hf_peer import bench_hf, load_hf_model
from larql.harness.contexts import context_ids
from larql.inference.ffn import DenseFfn
from larql.kv import parse_engine
from larql.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--engine", default="standard")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=args.dtype)
    ids = context_ids(model, args.prompt_tokens, default_text())
    settings = BenchSettings(new_tokens=args.new_tokens, warmup=3, repeats=args.repeats)
    ours = bench_engine(model, DenseFfn(model), parse_engine(args.engine), ids, settings)
    peer = bench_hf(load_hf_model(model), ids, args.new_tokens, args.repeats)
    report = {
        "model": model.name,
        "dtype": args.dtype,
        "threads": args.threads,
        "torch": torch.__version__,
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "larql": {
            "engine": args.engine,
            "prefill_ms": ours.prefill_ms,
            "decode_tok_s": ours.tok_s,
            "decode_tok_s_runs": ours.tok_s_runs,
        },
        "hf": {
            "prefill_ms": peer.prefill_ms,
            "decode_tok_s": peer.tok_s,
            "decode_tok_s_runs": peer.tok_s_runs,
        },
        "decode_ratio": (ours.tok_s or 0.0) / peer.tok_s,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{model.name} {args.dtype}, {args.threads} threads, torch {torch.__version__}, "
        f"prompt {len(ids)} + {args.new_tokens} new tokens, median of {args.repeats}"
    )
    rows = ((f"larql {args.engine}", report["larql"]), ("HF generate (DynamicCache)", report["hf"]))
    for label, r in rows:
        runs = ", ".join(f"{x:.1f}" for x in r["decode_tok_s_runs"])
        print(
            f"  {label:<28} prefill {r['prefill_ms']:8.1f} ms   decode "
            f"{r['decode_tok_s']:6.1f} tok/s  (runs: {runs})"
        )
    print(f"  decode ratio larql / HF: {report['decode_ratio']:.2f}×")


if __name__ == "__main__":
    main()
