"""What the FFN backends cost and change, on the default model.

1. walk:k at several k vs dense: decode tok/s (standard engine, whole tokens, median of
   repeats) and KL(dense ‖ walk) of the next-token distribution, teacher-forced over the
   shipped Apache-2.0 text, with top-1 agreement.
2. remote FFN over loopback: an FFN shard in its own process on 127.0.0.1; for each wire
   format (f32, f16, i8) the ms per token remote-walk adds to a local dense decode, and the raw
   transport cost of one token's 30 layers sent streaming (one request per layer, what
   generation does) vs as one batched request (an approximate predispatch:
   every layer on the same residual — transport only, not a correct forward).

    .venv/bin/python benchmarks/ffn_backends.py [--ks 1024,768,512,256,100] [--tokens 32]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

import torch

from larql.data import default_text
from larql.harness.bench.engine_bench import BenchSettings, bench_engine
from larql.inference.ffn import DenseFfn, build_ffn
from larql.inference.ffn.remote import RemoteWalkFfn
from larql.inference.generation import teacher_forced_logits
from larql.kv import parse_engine
from larql.models import Model, load_model

PROMPT = "The capital of France is"
SHARD = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
from larql.models import load_model
from larql.server.ffn_shard import run_ffn_shard
run_ffn_shard(load_model(sys.argv[2]), None, "127.0.0.1", 0)
"""


def kl_stats(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float, float]:
    """→ (mean KL, max KL, top-1 agreement) over the rows of two [N, V] logit tensors."""
    log_p = torch.log_softmax(reference.double(), -1)
    log_q = torch.log_softmax(other.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    agree = (reference.argmax(-1) == other.argmax(-1)).double().mean().item()
    return kl.mean().item(), kl.max().item(), agree


def tok_s(model: Model, ffn, settings: BenchSettings) -> float:
    ids = model.tokenizer.encode(PROMPT)
    row = bench_engine(model, ffn, parse_engine("standard"), ids, settings)
    if row.error:
        raise SystemExit(f"bench failed: {row.error}")
    assert row.tok_s is not None
    return row.tok_s


def walk_table(model: Model, ks: list[int], settings: BenchSettings, positions: int) -> None:
    ids = model.tokenizer.encode(default_text())[: 16 + positions]
    engine = parse_engine("standard")
    dense_logits = teacher_forced_logits(engine.build(model), model, DenseFfn(model), ids, 16)
    dense_rate = tok_s(model, DenseFfn(model), settings)
    specs = [
        "dense",
        "walk",
        *(f"walk:k={k}" for k in ks),
        "{walk:k=100}@layers=14-27;{dense}@otherwise",
    ]
    print(
        f"\n## walk:k vs dense ({len(ids) - 16} teacher-forced positions, "
        f"{settings.new_tokens} decode tokens × {settings.repeats} repeats)\n"
    )
    print("| FFN policy | tok/s | vs dense | KL mean (nats) | KL max | top-1 agree |")
    print("|---|---:|---:|---:|---:|---:|")
    for spec in specs:
        ffn = build_ffn(model, spec)
        rate = dense_rate if spec == "dense" else tok_s(model, ffn, settings)
        logits = teacher_forced_logits(engine.build(model), model, ffn, ids, 16)
        mean, worst, agree = kl_stats(dense_logits, logits)
        print(
            f"| `{spec}` | {rate:.1f} | {rate / dense_rate:.2f}× | {mean:.4g} | {worst:.4g} "
            f"| {agree:.3f} |"
        )


def start_shard(model_name: str, threads: int) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-c", SHARD, str(threads), model_name], stderr=subprocess.PIPE, text=True
    )
    assert process.stderr is not None
    for line in process.stderr:
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            return process, found[1]
    raise SystemExit(f"the shard exited with {process.wait()}")


def transport_ms(
    client: RemoteWalkFfn, layers: int, hidden: int, rounds: int
) -> tuple[float, float]:
    """Median ms for one token's layers: streaming (a request per layer) and one batch."""
    x = torch.randn(1, hidden)
    streaming, batched = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for layer in range(layers):
            client.forward(layer, x)
        streaming.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        client.forward_layers(range(layers), x)
        batched.append((time.perf_counter() - t0) * 1000)
    return statistics.median(streaming), statistics.median(batched)


def local_ffn_ms(model: Model, rounds: int) -> float:
    dense, x = DenseFfn(model), torch.randn(1, model.config.hidden_size, dtype=model.dtype)
    times = []
    with torch.inference_mode():
        for _ in range(rounds):
            t0 = time.perf_counter()
            for layer in range(model.config.num_layers):
                dense.forward(layer, x)
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def remote_table(model: Model, settings: BenchSettings, shard_threads: int, rounds: int) -> None:
    process, url = start_shard(model.name, shard_threads)
    layers, hidden = model.config.num_layers, model.config.hidden_size
    try:
        dense_ms = 1000 / tok_s(model, DenseFfn(model), settings)
        local = local_ffn_ms(model, rounds)
        print(
            f"\n## remote FFN over loopback (shard process on {url}, {shard_threads} torch "
            f"thread(s); {layers} layers)\n"
        )
        print(
            f"local dense decode: {dense_ms:.2f} ms/token; the {layers} FFNs alone "
            f"{local:.2f} ms/token\n"
        )
        print(
            "| wire | decode ms/token | added ms/token | bytes/token (req + resp) | "
            "streaming: 30 requests, ms | batched: 1 request, ms |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for wire in ("f32", "f16", "i8"):
            router = build_ffn(model, f"remote-walk:endpoint={url},wire={wire}")
            client = router.backends[0]
            assert isinstance(client, RemoteWalkFfn)
            remote_ms = 1000 / tok_s(model, router, settings)
            before = (client.stats.bytes_sent + client.stats.bytes_received, client.stats.requests)
            x = torch.randn(1, hidden)
            for layer in range(layers):
                client.forward(layer, x)
            per_token = client.stats.bytes_sent + client.stats.bytes_received - before[0]
            stream_ms, batch_ms = transport_ms(client, layers, hidden, rounds)
            print(
                f"| {wire} | {remote_ms:.2f} | {remote_ms - dense_ms:+.2f} | {per_token:,} "
                f"| {stream_ms:.2f} | {batch_ms:.2f} |"
            )
            router.close()
    finally:
        process.kill()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ks", default="1024,768,512,256,100")
    parser.add_argument("--tokens", type=int, default=32, help="timed decode tokens per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--positions", type=int, default=128, help="teacher-forced positions")
    parser.add_argument("--rounds", type=int, default=20, help="transport timing rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shard-threads", type=int, default=1)
    parser.add_argument("--skip-remote", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.shard_threads))
    model = load_model(args.model)
    settings = BenchSettings(new_tokens=args.tokens, warmup=3, repeats=args.repeats)
    print(f"# FFN backends — {model.name}, float32, {torch.get_num_threads()} torch threads")
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    walk_table(model, [int(k) for k in args.ks.split(",")], settings, args.positions)
    if not args.skip_remote:
        remote_table(model, settings, args.shard_threads, args.rounds)


if __name__ == "__main__":
    main()
