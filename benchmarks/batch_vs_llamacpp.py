"""Batched decode against llama.cpp's on the CPU: B greedy streams stepping together, the same
GGUF, in interleaved rounds of fresh processes.

Each round runs llama.cpp (llama-cpp-python's low-level API: one `llama_decode` per step over
a batch of B sequences, each its own sequence id in one unified K/V cache) and then `larql
bench --batch` (`step_together` over B sessions, as `larql serve` steps them), both on the same
prompt token ids (the shipped text's first `--prompt-tokens`, as `larql bench --prompt-tokens` cuts
them) for every stream, greedy (the argmax of each stream's logits), `--threads` threads.
Both time the decode steps only, after `--warmup` steps: aggregate tok/s = B × steps / time.
Prints, per B, each peer's aggregate tok/s, its ratio over its own B = 1 and larql's ratio
over llama.cpp.

llama-cpp-python lives in a venv of its own (see `cpu_vs_llamacpp.py`):

    python3 -m venv ../llama-venv && ../llama-venv/bin/pip install llama-cpp-python==0.3.36
    .venv/bin/python benchmarks/batch_vs_llamacpp.py [--batch 1,8] [--rounds 3]
        [--prompt-tokens 8] [--new-tokens 48] [--threads 2] [--weights auto]
        [--llama-python PATH] [--json]

Without that venv the script says how to make it and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from cpu_vs_llamacpp import add_peer_arguments, peer_inputs

# Runs in the llama venv: argv = gguf path, threads, new tokens, warm-up steps, batch sizes
# (comma-separated); the prompt ids on stdin → one JSON line {B: tok/s}.
LLAMA_ROUND = r"""
import json, sys, time
import numpy as np
import llama_cpp as L
path, (threads, new_tokens, warmup) = sys.argv[1], (int(a) for a in sys.argv[2:5])
batches = [int(b) for b in sys.argv[5].split(",")]
ids = json.loads(sys.stdin.read())
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
result = {}
for streams in batches:
    params = L.llama_context_default_params()
    params.n_ctx = streams * (len(ids) + warmup + new_tokens + 8)
    params.n_batch = max(512, streams * len(ids))
    params.n_seq_max, params.kv_unified = streams, True
    params.n_threads = params.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, params)
    batch = L.llama_batch_init(params.n_batch, 0, streams)

    def decode(items):  # (token, position, sequence, wants logits)
        batch.n_tokens = len(items)
        for j, (token, pos, seq, logits) in enumerate(items):
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = token, pos, 1
            batch.seq_id[j][0], batch.logits[j] = seq, logits
        assert L.llama_decode(ctx, batch) == 0

    decode([(t, p, s, p == len(ids) - 1) for s in range(streams) for p, t in enumerate(ids)])
    rows = [s * len(ids) + len(ids) - 1 for s in range(streams)]
    pos = len(ids)
    for step in range(warmup + new_tokens):
        if step == warmup:
            start = time.perf_counter()
        logits = [L.llama_get_logits_ith(ctx, r) for r in rows]
        picks = [int(np.ctypeslib.as_array(x, shape=(n_vocab,)).argmax()) for x in logits]
        decode([(picks[s], pos, s, True) for s in range(streams)])
        rows, pos = list(range(streams)), pos + 1
    result[streams] = streams * new_tokens / (time.perf_counter() - start)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
print(json.dumps(result))
"""


def llama_round(
    python: Path, gguf: Path, ids: list[int], args: argparse.Namespace
) -> dict[int, float]:
    done = subprocess.run(
        [
            str(python),
            "-c",
            LLAMA_ROUND,
            str(gguf),
            str(args.threads),
            str(args.new_tokens),
            str(args.warmup),
            args.batch,
        ],
        input=json.dumps(ids),
        capture_output=True,
        text=True,
        check=True,
    )
    return {int(b): tok_s for b, tok_s in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def larql_round(args: argparse.Namespace, prompt_tokens: int) -> dict[int, float]:
    larql = Path(sys.executable).with_name("larql")
    done = subprocess.run(
        [
            str(larql),
            "bench",
            "--model",
            args.model,
            "--engine",
            "standard",
            "--batch",
            args.batch,
            "--prompt-tokens",
            str(prompt_tokens),
            "-n",
            str(args.new_tokens),
            "--warmup",
            str(args.warmup),
            "--repeats",
            "1",
            "--threads",
            str(args.threads),
            "--weights",
            args.weights,
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return {row["batch"]: row["tok_s"] for row in json.loads(done.stdout)["batch_rows"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8", help="streams per step, comma-separated")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--weights", default="auto", help="larql's --weights (blocks-int8: llama.cpp's int8 inputs)"
    )
    add_peer_arguments(parser, prompt_tokens=8, new_tokens=48)
    args = parser.parse_args()

    inputs = peer_inputs(args)
    if inputs is None:
        return
    gguf, ids = inputs
    runs: dict[str, list[dict[int, float]]] = {"llama.cpp": [], "larql": []}
    for round_index in range(args.rounds):
        runs["llama.cpp"].append(llama_round(args.llama_python, gguf, ids, args))
        runs["larql"].append(larql_round(args, len(ids)))
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    batches = [int(b) for b in args.batch.split(",")]
    medians = {
        peer: {b: statistics.median(r[b] for r in rounds) for b in batches}
        for peer, rounds in runs.items()
    }
    report = {
        "model": args.model,
        "gguf": gguf.name,
        "threads": args.threads,
        "weights": args.weights,
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "tok_s": medians,
        "runs": runs,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{gguf.name}, {len(ids)}-token prompts, {args.new_tokens} greedy tokens a stream, "
        f"{args.threads} threads, larql --weights {args.weights}, "
        f"median of {args.rounds} interleaved rounds"
    )
    print(
        "| streams | llama.cpp tok/s | × its one stream | larql tok/s | × its one stream "
        "| larql × llama.cpp |"
    )
    print("|---|---|---|---|---|---|")
    first = batches[0]
    for b in batches:
        llama, larql = medians["llama.cpp"][b], medians["larql"][b]
        print(
            f"| {b} | {llama:.1f} | {llama / medians['llama.cpp'][first]:.2f} | {larql:.1f} | "
            f"{larql / medians['larql'][first]:.2f} | {larql / llama:.2f} |"
        )


if __name__ == "__main__":
    main()
