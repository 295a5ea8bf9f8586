"""Tensor parallelism on several GPUs, every figure in one run of at most 10 minutes: builds
random-weight Llama directories of real shapes, checks that the ranks decode one process's
tokens, then times `larql bench` split over 1, 2, 4, 8 GPUs (as many as the machine has) against
transformers' own tensor parallelism; prints a table last and writes JSON.

    python benchmarks/tensor_parallel_gpu.py --tokenizer tokenizer.json --out OUT.json \\
        [--work DIR] [--steps exact,speed,hf,depth,big] [--budget 570]
    python benchmarks/tensor_parallel_gpu.py --tokenizer tokenizer.json --device cpu \\
        --shapes tiny --out dry.json       # the dry check: gloo, 2 ranks, a tiny shape

Steps, in order, each under its own timeout (and never past --budget seconds in all); a step
that fails or times out is a row of the table, and the next step runs:

- exact: the 1B shape in float32, `larql run` greedy, 32 tokens: one process's token ids, then
  each TP=N's under `python -m torch.distributed.run --nproc-per-node N -m larql run`. Any
  difference skips the timed steps (float32, so that the ranks' sums in another order move no
  argmax of these logits; bf16 would).
- speed: the 8B shape (Llama-3.1-8B: 32 layers, hidden 4096, 32/8 heads, MLP 14336, vocab
  128,256) in bf16, `larql bench --engine standard --prompt-tokens 128 -n 128 --repeats 3`
  under torchrun at TP=1, 2, 4, 8: tok/s, per-GPU bandwidth share, ratio to TP=1.
- hf: transformers' `tp_plan="auto"` on the same directory under torchrun (this file run as its
  worker), greedy, batch 1, 128-token prompt: decode tok/s = 127 / (time of 128 new tokens −
  time of 1). An API this transformers lacks is an error row.
- depth: `standard` vs `turbo-quant:bits=4` on the 8B shape at a depth of 32,000 tokens, TP=2.
- big: the 70B shape (Llama-3.1-70B: 80 layers, hidden 8192, 64/8 heads, MLP 28672; ~141 GB
  of bf16 files) at TP=4 and 8 (with at least 4 GPUs), batch 1 and 64 streams (`--batch 64`).
  Each rank reads its share of the files alone (docs/SCALE.md).

The directories are written with a repeating pseudo-random bf16 pattern (std 0.02, norms 1;
no NaN or Inf), in safetensors shards of at most 5 GB with HF's index file, several shards at
once: speed does not depend on the values, and no fidelity is measured on them. They are kept
in --work (a directory built by an earlier run with the same shape is reused); the 70B shape
needs ~141 GB free there (the 8B directory is removed first where the space is short).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARD_BYTES = 5 * 10**9  # HF's default shard size
PATTERN = 1_000_003  # elements of the repeated pattern: a prime, so no two rows of a matrix agree
PROMPT = "The capital of France is"


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "tiny": Shape(2, 64, 4, 2, 128, 0, False),  # vocab: the tokenizer's
    "1b": Shape(16, 2048, 32, 8, 8192, 49152, True),  # Llama-3.2-1B
    "8b": Shape(32, 4096, 32, 8, 14336, 128256, False),  # Llama-3.1-8B
    "70b": Shape(80, 8192, 64, 8, 28672, 128256, False),  # Llama-3.1-70B
}


# --- building a directory ---------------------------------------------------------------------


def tensors_of(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama tensor names and shapes, in the order HF writes them."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (shape.mlp, h)),
            (p + "mlp.up_proj.weight", (shape.mlp, h)),
            (p + "mlp.down_proj.weight", (h, shape.mlp)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not shape.tied:
        out.append(("lm_head.weight", (vocab, h)))
    return out


def config_of(shape: Shape, vocab: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.mlp,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "hidden_act": "silu",
        "tie_word_embeddings": shape.tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def build(name: str, directory: Path, tokenizer: Path, workers: int) -> dict[str, Any]:
    """Write the `name` shape to `directory` (kept if an earlier run wrote the same)."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer

    shape = SHAPES[name]
    vocab = max(shape.vocab, Tokenizer.from_file(str(tokenizer)).get_vocab_size(True))
    marker = directory / "built.json"
    wanted = {"shape": name, "vocab": vocab, "tensors": len(tensors_of(shape, vocab))}
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return {**wanted, "reused": True}
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    # the pattern: std 0.02 as HF's initialisation, tiled so a write is one slice of it
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(PATTERN, generator=g) * 0.02).to(torch.bfloat16)
    copies = 32
    tiled = np.tile(base.view(torch.int16).numpy().view(np.uint16), copies + 1)
    ones = np.full(1 << 20, 0x3F80, dtype=np.uint16)  # bf16 1.0

    def write_tensor(f: Any, name: str, count: int) -> None:
        if name.endswith("norm.weight"):
            for start in range(0, count, ones.size):
                f.write(ones[: min(ones.size, count - start)].data)
            return
        offset, left = zlib.crc32(name.encode()) % PATTERN, count
        while left:
            take = min(left, copies * PATTERN)
            f.write(tiled[offset : offset + take].data)
            left -= take
            offset = (offset + take) % PATTERN

    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for entry in tensors_of(shape, vocab):
        nbytes = 2 * _numel(entry[1])
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    count = len(shards)
    files = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    if count == 1:
        files = ["model.safetensors"]

    def write_shard(i: int) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        at = 0
        for tensor, dims in shards[i]:
            end = at + 2 * _numel(dims)
            header[tensor] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [at, end]}
            at = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        with open(directory / files[i], "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for tensor, dims in shards[i]:
                write_tensor(f, tensor, _numel(dims))

    with ThreadPoolExecutor(max(1, min(workers, len(shards)))) as pool:
        list(pool.map(write_shard, range(len(shards))))
    total = sum(2 * _numel(dims) for dims in (d for s in shards for _, d in s))
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {t: files[i] for i, s in enumerate(shards) for t, _ in s},
        }
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (directory / "config.json").write_text(json.dumps(config_of(shape, vocab), indent=1))
    shutil.copy(tokenizer, directory / "tokenizer.json")
    marker.write_text(json.dumps(wanted))
    return {**wanted, "reused": False, "bytes": total, "shards": len(shards)}


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


# --- running a step ---------------------------------------------------------------------------


class Steps:
    """Runs commands under their own timeouts inside the run's budget, and keeps the rows."""

    def __init__(self, budget: float, out: Path, report: dict[str, Any]) -> None:
        self.deadline = time.monotonic() + budget
        self.out, self.report = out, report
        report["steps"] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        self.report["steps"].append(row)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.report, indent=1))  # what is in so far survives
        shown = {k: v for k, v in row.items() if k != "log_tail"}
        print(json.dumps(shown), flush=True)
        return row

    def skip(self, step: str, why: str) -> dict[str, Any]:
        return self.add({"step": step, "status": "skipped", "error": why})

    def command(
        self, step: str, argv: list[str], timeout: float, env: dict[str, str]
    ) -> tuple[dict[str, Any], str]:
        """Run `argv` (its own process group, ended whole at the timeout) → (row, stdout)."""
        limit = min(timeout, self.left() - 5)
        if limit < 20:
            return {"step": step, "status": "skipped", "error": "out of time (--budget)"}, ""
        started = time.monotonic()
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                cwd=REPO,
                start_new_session=True,  # a group of its own, ended whole at the timeout
            )
            try:
                stdout, _ = proc.communicate(timeout=limit)
                status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
            except subprocess.TimeoutExpired:
                _end_group(proc)
                stdout, status = "", f"timeout after {limit:.0f} s"
            err.seek(0)
            tail = err.read()[-3000:]
        row: dict[str, Any] = {
            "step": step,
            "status": status,
            "seconds": round(time.monotonic() - started, 1),
        }
        if status != "ok":
            row["error"] = status if status.startswith("timeout") else _last_line(tail) or status
            row["log_tail"] = tail
        return row, stdout

    def call(self, step: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """A step run in this process (building a directory)."""
        started = time.monotonic()
        try:
            row = {"step": step, "status": "ok", **work()}
        except Exception as e:
            row = {"step": step, "status": "error", "error": f"{type(e).__name__}: {e}"}
        row["seconds"] = round(time.monotonic() - started, 1)
        return self.add(row)


def _end_group(proc: subprocess.Popen[str]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_line(text: str) -> str:
    """The error a failed command's stderr names: larql's one line (`error: ...`), else the last
    exception line of a traceback (torchrun's own report of a failed child left out)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    larql = [line for line in lines if line.lower().startswith("error:")]
    raised = [
        line
        for line in lines
        if re.match(r"^[\w.]*(Error|Exception)\b", line) and "ChildFailedError" not in line
    ]
    line = (larql or raised or lines or [""])[-1]
    return line[len("error:") :].strip()[:300] if line in larql else line[:300]


def launcher(ranks: int, torchrun: bool = True) -> list[str]:
    """The command prefix of `larql` on `ranks` ranks: torchrun with one process per GPU."""
    if not torchrun:
        return [sys.executable, "-m", "larql"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "-m",
        "larql",
    ]


# --- the steps --------------------------------------------------------------------------------


@dataclass
class Plan:
    device: str
    sizes: list[int]  # TP sizes of the speed steps
    big_sizes: list[int]
    shapes: dict[str, str]  # role (exact, speed, big) → shape name
    new_tokens: int
    depth: int
    threads: list[str]  # --threads for larql on the CPU
    env: dict[str, str]


def exact_step(steps: Steps, plan: Plan, model: Path) -> bool:
    """One process's greedy tokens, then each TP=N's; False where any differ."""
    args = ["run", PROMPT, "-m", str(model), "-n", "32", "--output", "json"]
    args += ["--device", plan.device, "--dtype", "float32", *plan.threads]
    runs: dict[int, list[int]] = {}
    agreed = True
    for n in plan.sizes:
        argv = launcher(n, torchrun=n > 1) + args + ["--tensor-parallel", str(n)]
        row, stdout = steps.command(f"exact tp={n}", argv, 240, plan.env)
        if row["status"] == "ok":
            try:
                runs[n] = json.loads(stdout.strip().splitlines()[-1])["token_ids"]
            except (ValueError, KeyError, IndexError) as e:
                row.update(status="error", error=f"no token_ids in the output: {e}")
        if n in runs and 1 in runs:
            row["tokens"] = len(runs[n])
            row["equal_to_tp1"] = runs[n] == runs[1]
            if runs[n] != runs[1]:
                first = next(
                    (i for i, (a, b) in enumerate(zip(runs[1], runs[n], strict=False)) if a != b),
                    min(len(runs[1]), len(runs[n])),
                )
                row["first_difference"] = first
        agreed &= row["status"] == "ok" and row.get("equal_to_tp1", n == 1)
        steps.add(row)
        if 1 not in runs:
            break  # no reference to compare with
    return agreed


def bench_rows(
    steps: Steps, plan: Plan, step: str, n: int, args: list[str], timeout: float
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`larql bench` on n ranks (under torchrun) → (row, its JSON)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "bench.json"
        argv = [*launcher(n), "bench", *args, "--tensor-parallel", str(n)]
        argv += ["--device", plan.device, "--output-file", str(result), "-q", *plan.threads]
        row, _ = steps.command(step, argv, timeout, plan.env)
        report = json.loads(result.read_text()) if result.exists() else None
    if row["status"] == "ok" and report is None:
        row.update(status="error", error="bench wrote no JSON")
    return row, report


def _decode_figures(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "tok_s": row.get("tok_s"),
        "p50_ms": (row.get("decode_ms") or {}).get("p50"),
        "bandwidth_share": row.get("bandwidth_share"),
        "achieved_gbs": row.get("achieved_gbs"),
        "state_bytes": (row.get("memory") or {}).get("state"),
        "engine_error": row.get("error"),
        "decode_path": row.get("decode_path"),
    }


def speed_step(steps: Steps, plan: Plan, model: Path) -> dict[int, float]:
    args = ["-m", str(model), "--dtype", _speed_dtype(plan), "--engine", "standard"]
    args += ["--prompt-tokens", "128", "-n", str(plan.new_tokens), "--repeats", "3"]
    rates: dict[int, float] = {}
    for n in plan.sizes:
        step = f"bench {plan.shapes['speed']} tp={n}"
        row, report = bench_rows(steps, plan, step, n, args, 240)
        if report is not None and report["rows"]:
            row.update(_decode_figures(report["rows"][0]))
            row["copy_bandwidth_gbs"] = report.get("copy_bandwidth_gbs")
            if row["tok_s"]:
                rates[n] = row["tok_s"]
        if n in rates and 1 in rates:
            row["ratio_to_tp1"] = rates[n] / rates[1]
        steps.add(row)
    return rates


def hf_step(steps: Steps, plan: Plan, model: Path, larql_rates: dict[int, float]) -> None:
    for n in plan.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "hf.json"
            argv = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={n}",
                str(Path(__file__).resolve()),
                "--hf-worker",
                str(model),
                "--hf-result",
                str(result),
                "--device",
                plan.device,
                "--new",
                str(plan.new_tokens),
                "--hf-dtype",
                _speed_dtype(plan),
            ]
            row, _ = steps.command(f"hf tp_plan tp={n}", argv, 300, plan.env)
            found = json.loads(result.read_text()) if result.exists() else {}
        if "error" in found:  # the worker's own one-line error (an API this version lacks)
            row.update(status="error", error=found["error"])
        row.update({k: v for k, v in found.items() if k != "error"})
        if row.get("tok_s") and n in larql_rates:
            row["larql_over_hf"] = larql_rates[n] / row["tok_s"]
        steps.add(row)


def depth_step(steps: Steps, plan: Plan, model: Path) -> None:
    n = 2 if 2 in plan.sizes else max(plan.sizes)
    args = ["-m", str(model), "--dtype", _speed_dtype(plan)]
    args += ["--engine", "standard;turbo-quant:bits=4", "--depths", str(plan.depth)]
    args += ["-n", "32", "--repeats", "2", "--warmup", "2"]
    row, report = bench_rows(steps, plan, f"depth {plan.depth} tp={n}", n, args, 420)
    if report is not None:
        engines = {r["spec"]: _decode_figures(r) for r in report["rows"]}
        row["engines"] = engines
        standard, turbo = engines.get("standard", {}), engines.get("turbo-quant", {})
        if standard.get("tok_s") and turbo.get("tok_s"):
            row["turbo_over_standard"] = turbo["tok_s"] / standard["tok_s"]
        if standard.get("state_bytes") and turbo.get("state_bytes"):
            row["state_ratio"] = turbo["state_bytes"] / standard["state_bytes"]
    steps.add(row)


def big_step(steps: Steps, plan: Plan, model: Path) -> None:
    args = ["-m", str(model), "--dtype", _speed_dtype(plan), "--engine", "standard"]
    args += ["--prompt-tokens", "128", "-n", "32", "--repeats", "2", "--warmup", "2"]
    args += ["--batch", "64"]
    for n in plan.big_sizes:
        row, report = bench_rows(steps, plan, f"bench {plan.shapes['big']} tp={n}", n, args, 420)
        if report is not None:
            if report["rows"]:
                row.update(_decode_figures(report["rows"][0]))
            batched = [r for r in report.get("batch_rows", []) if r.get("batch") == 64]
            if batched:
                row["batch64_tok_s"] = batched[0].get("tok_s")
                row["batch64_ms_per_token"] = batched[0].get("ms_per_token")
                row["batch64_error"] = batched[0].get("error")
        steps.add(row)


def _speed_dtype(plan: Plan) -> str:
    return "bfloat16" if plan.device == "cuda" else "float32"


# --- transformers' tensor parallelism (this file as torchrun's worker) ------------------------


def hf_worker(args: argparse.Namespace) -> None:
    """One rank of transformers' `tp_plan="auto"`: rank 0 writes tok/s or the error."""
    import torch

    rank = int(os.environ.get("RANK", "0"))
    found: dict[str, Any] = {}
    try:
        import transformers
        from transformers import AutoModelForCausalLM

        found["transformers"] = transformers.__version__
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dtype = getattr(torch, args.hf_dtype)
        major = int(transformers.__version__.split(".")[0])
        kind = {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}
        model = AutoModelForCausalLM.from_pretrained(args.hf_worker, tp_plan="auto", **kind)
        model.eval()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 1000, (1, 128), generator=g).to(model.device)

        def timed(new: int) -> float:
            _sync(args.device)
            started = time.perf_counter()
            with torch.no_grad():
                out = model.generate(
                    ids,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                )
            _sync(args.device)
            assert out.shape[1] == ids.shape[1] + new, out.shape
            return time.perf_counter() - started

        timed(4)  # warm-up
        first = min(timed(1) for _ in range(2))
        whole = min(timed(args.new) for _ in range(2))
        found["tok_s"] = (args.new - 1) / (whole - first)
        found["prefill_ms"] = first * 1000
        found["cache"] = "transformers' default (DynamicCache), eager"
    except Exception as e:
        found["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    if rank == 0:
        Path(args.hf_result).write_text(json.dumps(found))
    if "error" in found:
        print(found["error"], file=sys.stderr)
        sys.exit(1)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# --- the run ----------------------------------------------------------------------------------


def summarize(report: dict[str, Any]) -> None:
    print(f"\n== tensor parallel: {report['machine']} ==")
    print(f"{'step':<26} {'status':<12} {'figures'}")
    for row in report["steps"]:
        figures = []
        for key, fmt in (
            ("equal_to_tp1", "equal to TP=1: {}"),
            ("first_difference", "first difference at {}"),
            ("tok_s", "{:.1f} tok/s"),
            ("ratio_to_tp1", "{:.2f}x TP=1"),
            ("bandwidth_share", "bw share {:.0%}/GPU"),
            ("larql_over_hf", "larql {:.2f}x HF"),
            ("batch64_tok_s", "64 streams {:.1f} tok/s"),
            ("turbo_over_standard", "turbo/standard {:.2f}x"),
            ("state_ratio", "state {:.2f}x"),
            ("bytes", "{:,} bytes"),
            ("reused", "reused: {}"),
        ):
            if row.get(key) is not None:
                figures.append(fmt.format(row[key]))
        for spec, engine in (row.get("engines") or {}).items():
            if engine.get("tok_s"):
                figures.append(f"{spec} {engine['tok_s']:.1f} tok/s")
        if row.get("seconds") is not None:
            figures.append(f"[{row['seconds']:.0f} s]")
        if row.get("error"):
            figures.append(f"error: {row['error']}")
        print(f"{row['step']:<26} {row['status']:<12} {'  '.join(figures)}")
    for line in report.get("notes", []):
        print(line)


def machine(device: str, ranks: int | None) -> tuple[str, int]:
    import torch

    if device == "cuda":
        count = torch.cuda.device_count()
        name = torch.cuda.get_device_name(0) if count else "no GPU"
        return f"{count} × {name}, torch {torch.__version__}", ranks or count
    return f"cpu (dry run, gloo), torch {torch.__version__}", ranks or 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json for the directories")
    parser.add_argument("--out", type=Path, help="the JSON (default: $OUT or . /tp_gpu.json)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "larql-tp")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shapes", default="1b,8b,70b", help="exact,speed,big shapes; or tiny")
    parser.add_argument("--steps", default="exact,speed,hf,depth,big")
    parser.add_argument("--ranks", type=int, help="the most ranks (default: the GPUs; cpu: 2)")
    parser.add_argument("--budget", type=float, default=570.0, help="seconds for the whole run")
    parser.add_argument("--new", type=int, help="timed tokens (default 128; tiny: 8)")
    parser.add_argument("--depth", type=int, help="the depth step's context (default 32000)")
    parser.add_argument("--hf-worker", help=argparse.SUPPRESS)
    parser.add_argument("--hf-result", help=argparse.SUPPRESS)
    parser.add_argument("--hf-dtype", default="bfloat16", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_worker:
        hf_worker(args)
        return
    if args.tokenizer is None or not args.tokenizer.is_file():
        parser.error("--tokenizer: a tokenizer.json is needed (the GPU machine has no network)")
    out = args.out or Path(os.environ.get("OUT", ".")) / "tp_gpu.json"
    names = args.shapes.split(",")
    names = names * 3 if len(names) == 1 else names
    if len(names) != 3 or any(n not in SHAPES for n in names):
        parser.error(f"--shapes: three of {', '.join(SHAPES)} (exact,speed,big), or one")
    tiny = names == ["tiny"] * 3
    chosen = set(args.steps.split(","))
    unknown = chosen - {"exact", "speed", "hf", "depth", "big"}
    if unknown:
        parser.error(f"--steps: unknown {', '.join(sorted(unknown))}")

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        env.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")
    described, most = machine(args.device, args.ranks)
    sizes = [n for n in (1, 2, 4, 8) if n <= most]
    big_sizes = [n for n in sizes if n >= 4]
    if args.device == "cpu" and not big_sizes:
        big_sizes = [max(sizes)]  # the dry check runs the big step's code at its largest size
    plan = Plan(
        device=args.device,
        sizes=sizes,
        big_sizes=big_sizes,
        shapes=dict(zip(("exact", "speed", "big"), names, strict=True)),
        new_tokens=args.new or (8 if tiny else 128),
        depth=args.depth or (256 if tiny else 32000),
        threads=["--threads", "1"] if args.device == "cpu" else [],
        env=env,
    )
    report: dict[str, Any] = {"machine": described, "sizes": sizes, "shapes": plan.shapes}
    report["work"] = str(args.work)
    args.work.mkdir(parents=True, exist_ok=True)
    report["work_free_bytes"] = shutil.disk_usage(args.work).free
    print(f"{described}; TP sizes {sizes}; work {args.work} ({report['work_free_bytes']:,} B free)")
    steps = Steps(args.budget, out, report)
    report["notes"] = []
    workers = max(1, min(16, (os.cpu_count() or 2) // 2))

    def directory(role: str) -> Path | None:
        name = plan.shapes[role]
        target = args.work / name
        row = steps.call(f"build {name}", lambda: build(name, target, args.tokenizer, workers))
        return target if row["status"] == "ok" else None

    exact_ok = True
    if "exact" in chosen:
        model = directory("exact")
        exact_ok = model is not None and exact_step(steps, plan, model)
        if not exact_ok:
            differ = any(row.get("equal_to_tp1") is False for row in report["steps"])
            line = (
                "EXACTNESS FAILED: TP=N's greedy tokens are not TP=1's; timed steps skipped"
                if differ
                else "EXACTNESS NOT ESTABLISHED: a run of the check failed; timed steps skipped"
            )
            report["notes"].append(line)
            print(line, flush=True)
    else:
        report["notes"].append("exactness not checked in this run (--steps)")
    timed = [s for s in ("speed", "hf", "depth", "big") if s in chosen]
    if not exact_ok:
        for step in timed:
            steps.skip(step, "exactness failed")
        timed = []
    rates: dict[int, float] = {}
    if {"speed", "hf", "depth"} & set(timed):
        model = directory("speed")
        if model is None:
            for step in ("speed", "hf", "depth"):
                if step in timed:
                    steps.skip(step, "its directory was not built")
        else:
            if "speed" in timed:
                rates = speed_step(steps, plan, model)
            if "hf" in timed:
                hf_step(steps, plan, model, rates)
            if "depth" in timed:
                depth_step(steps, plan, model)
    if "big" in timed:
        if not plan.big_sizes:
            steps.skip("big", f"needs at least 4 GPUs (this machine: {most})")
        else:
            short = _make_room(args.work, plan)
            model = None if short else directory("big")
            if short:
                steps.skip("big", short)
            elif model is None:
                steps.skip("big", "its directory was not built")
            else:
                big_step(steps, plan, model)
    out.write_text(json.dumps(report, indent=1))
    summarize(report)
    print(f"\nJSON: {out}")


def _make_room(work: Path, plan: Plan) -> str | None:
    """Remove the speed shape's directory where the big one would not fit beside it; why the
    big one cannot be written, or None."""
    name = plan.shapes["big"]
    if (work / name / "built.json").exists():
        return None
    shape = SHAPES[name]
    need = 2 * sum(_numel(d) for _, d in tensors_of(shape, max(shape.vocab, 1))) * 1.02
    if shutil.disk_usage(work).free < need and plan.shapes["speed"] != name:
        shutil.rmtree(work / plan.shapes["speed"], ignore_errors=True)
    free = shutil.disk_usage(work).free
    if free < need:
        return f"the {name} shape needs {need / 1e9:.0f} GB in --work; {free / 1e9:.0f} GB free"
    return None


if __name__ == "__main__":
    main()
