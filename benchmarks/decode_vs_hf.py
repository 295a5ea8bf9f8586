"""larql `standard` against HF transformers `generate` (DynamicCache) in one run: same GGUF
weights (transformers dequantizes them itself), same dtype, same threads, same prompt and token
count. Prints prefill ms and decode tok/s of each and the ratio.

    .venv/bin/python benchmarks/decode_vs_hf.py [--prompt-tokens 256] [--new-tokens 64]
        [--repeats 3] [--threads 2] [--dtype float32] [--engine standard] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import time
from pathlib import Path

import torch

from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate
from larql.kv import from_name
from larql.models import load_model

TEXT = Path(__file__).resolve().parents[1] / "LICENSE"


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT.read_text())
    if len(ids) < n:
        raise SystemExit(f"{TEXT} has only {len(ids)} tokens")
    return ids[:n]


def time_larql(model, spec: str, ids: list[int], new_tokens: int) -> dict:
    engine = from_name(spec).build(model)
    result = generate(engine, model, DenseFfn(model), ids, new_tokens, stop_ids=frozenset())
    assert len(result.tokens) == new_tokens
    return {
        "prefill_ms": result.prefill_ms,
        "decode_tok_s": result.decode_tok_s,
        "tokens": result.tokens,
    }


class _TokenClock:
    """A transformers streamer that timestamps every token `generate` emits."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def time_hf(hf_model, ids: list[int], new_tokens: int) -> dict:
    clock = _TokenClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            streamer=clock,
            pad_token_id=0,
        )
    # times[0] is the prompt being echoed, times[1] the first new token, then one per step
    first, last = clock.times[1], clock.times[-1]
    steps = len(clock.times) - 2
    return {
        "prefill_ms": (first - t0) * 1000,
        "decode_tok_s": steps / (last - first),
        "tokens": out[0, len(ids) :].tolist(),
    }


def load_hf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    with contextlib.redirect_stderr(io.StringIO()):
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


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
    hf_model = load_hf(model.source, model.dtype).eval()
    ids = prompt_ids(model.tokenizer, args.prompt_tokens)

    time_larql(model, args.engine, ids, 4)  # warm-up both
    time_hf(hf_model, ids, 4)
    larql_runs, hf_runs = [], []
    for _ in range(args.repeats):  # interleaved, so drift hits both alike
        larql_runs.append(time_larql(model, args.engine, ids, args.new_tokens))
        hf_runs.append(time_hf(hf_model, ids, args.new_tokens))

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
            "prefill_ms": median_of(larql_runs, "prefill_ms"),
            "decode_tok_s": median_of(larql_runs, "decode_tok_s"),
            "decode_tok_s_runs": [r["decode_tok_s"] for r in larql_runs],
        },
        "hf": {
            "prefill_ms": median_of(hf_runs, "prefill_ms"),
            "decode_tok_s": median_of(hf_runs, "decode_tok_s"),
            "decode_tok_s_runs": [r["decode_tok_s"] for r in hf_runs],
        },
        "same_tokens": larql_runs[0]["tokens"] == hf_runs[0]["tokens"],
    }
    report["decode_ratio"] = report["larql"]["decode_tok_s"] / report["hf"]["decode_tok_s"]
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{model.name} {args.dtype}, {args.threads} threads, torch {torch.__version__}, "
          f"prompt {len(ids)} + {args.new_tokens} new tokens, median of {args.repeats}")  # fmt: skip
    for who in ("larql", "hf"):
        r = report[who]
        label = f"larql {args.engine}" if who == "larql" else "HF generate (DynamicCache)"
        runs = ", ".join(f"{x:.1f}" for x in r["decode_tok_s_runs"])
        print(f"  {label:<28} prefill {r['prefill_ms']:8.1f} ms   decode "
              f"{r['decode_tok_s']:6.1f} tok/s  (runs: {runs})")  # fmt: skip
    print(f"  decode ratio larql / HF: {report['decode_ratio']:.2f}×   "
          f"same greedy tokens: {report['same_tokens']}")  # fmt: skip


if __name__ == "__main__":
    main()
