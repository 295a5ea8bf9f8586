"""larql's ruler suite side by side with kvpress: the same weights, contexts, questions and
greedy decoding, at the same keep fractions; one table of task × method × keep → score, bytes.

The samples are larql's (`larql accuracy --suite ruler`'s generator, the same seed); their
token ids go to a kvpress worker as JSON, so both sides see the same tokens. kvpress's side runs
its pipeline's own compress-then-ask path (`KVPressTextGenerationPipeline._forward`: the
context prefilled under the press, then each question greedily on the compressed cache, the
answer removed after it) on the model transformers loads from the same GGUF (dequantised to
`--dtype`, float32 by default); larql's side loads the same GGUF with its float weights
(`weights="float"`) in that dtype. Both run on `--device` (cpu or cuda). Both continuations are
cut and scored by the same function (`larql.harness.ruler.tasks.answer_text` / `query_score`).
Bytes: kvpress's the K/V tensors its cache holds after the context; larql's the engine's state
after it.

The contexts are raw text (no chat template) on both sides; kvpress's KVzip reads its tokenizer
again from `model.config.name_or_path`, so the worker saves the loaded GGUF tokenizer (its chat
template left out, as larql's `kvzip` reconstructs a raw context: "Repeat the previous context
exactly." then a newline) to a temporary folder and points the config there.

kvpress is not a dependency of larql (it pins its own transformers), so it runs in a Python of
its own: a venv beside the checkout by default,

    python3 -m venv ../kvpress-venv && ../kvpress-venv/bin/pip install kvpress==0.5.5 \\
        transformers==4.57.6 gguf --extra-index-url https://download.pytorch.org/whl/cpu
    .venv/bin/python benchmarks/vs_kvpress.py [--quick] [--tasks niah-single,niah-multikey]
        [--lengths 1024] [--samples 2] [--keeps 0.5,0.25,0.1] [--presses snapkv,tova]
        [--engines "snapkv:budget={budget}"] [--device cpu|cuda] [--dtype float32]
        [--kvpress-python PYTHON] [--kvpress-pythonpath DIR] [--json]

or any Python with the packages unpacked in a folder (`pip install --target DIR kvpress==0.5.5
transformers==4.57.6 gguf`): `--kvpress-python python3 --kvpress-pythonpath DIR` (DIR goes first
on the worker's PYTHONPATH; several folders are joined by the path separator). `--kvpress-python`
is a path or a command on PATH (`KVPRESS_PY` sets its default). The worker runs with the Hugging
Face libraries offline (`HF_HUB_OFFLINE=1`, `TRANSFORMERS_OFFLINE=1`): it reads the GGUF only.

Without that Python the script says how to make it and exits 0. `--engines` are larql specs in
which `{keep}` becomes the keep fraction, `{budget}` the rows it keeps of each sample's
context and `{half}` half of them; a template whose engine the catalog lacks is left out (the
default lists every eviction engine that takes `keep=` where the catalog has it, and `snapkv` /
`h2o` by budget).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from larql.errors import LarqlError
from larql.harness.ruler.run import score_sample
from larql.harness.ruler.tasks import (
    TASKS,
    Sample,
    answer_text,
    generate_samples,
    query_score,
)
from larql.inference.ffn import build_ffn
from larql.kv.catalog import CATALOG
from larql.models import load_model
from larql.models.registry import resolve_model_path

DEFAULT_KVPRESS_PYTHON = Path("..") / "kvpress-venv" / "bin" / "python"
INSTALL = (
    "python3 -m venv ../kvpress-venv && ../kvpress-venv/bin/pip install kvpress==0.5.5 "
    "transformers==4.57.6 gguf --extra-index-url https://download.pytorch.org/whl/cpu"
)
PRESSES = ("snapkv", "expected-attention", "kvzip", "keydiff", "tova")
DTYPES = ("float32", "bfloat16", "float16")
ENGINES = (
    "snapkv:budget={budget}",
    "h2o:budget={budget},recent={half}",
    "expected-attention:keep={keep}",
    "kvzip:keep={keep}",
    "keydiff:keep={keep}",
    "tova:keep={keep}",
)

# Runs in the kvpress Python: argv = the GGUF's directory and file name, the device, the dtype;
# stdin = {"presses": [[name, keep]...], "samples": [{"context": [ids], "questions": [[ids]...],
# "max_new": n}]}; one JSON line per sample × press on stdout.
WORKER = r"""
import json, sys, tempfile, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline
import kvpress

torch.set_grad_enabled(False)
folder, name, device, dtype = sys.argv[1:5]
job = json.loads(sys.stdin.read())
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
model = model.to(device).eval()
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
# KVzip loads a tokenizer from model.config.name_or_path (without the gguf_file): give it this
# one, saved without its chat template (the contexts here are raw text, no template's prefix)
plain = tempfile.TemporaryDirectory(prefix="kvpress-tokenizer-")
template, tokenizer.chat_template = tokenizer.chat_template, None
tokenizer.save_pretrained(plain.name)
model.config.save_pretrained(plain.name)
tokenizer.chat_template = template
model.config.name_or_path = plain.name
pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device=device)
CLASSES = {"snapkv": "SnapKVPress", "expected-attention": "ExpectedAttentionPress",
           "kvzip": "KVzipPress", "keydiff": "KeyDiffPress", "tova": "TOVAPress"}
for i, sample in enumerate(job["samples"]):
    for press_name, keep in job["presses"]:
        row = {"sample": i, "press": press_name, "keep": keep}
        try:
            press = None
            if press_name != "none":
                press = getattr(kvpress, CLASSES[press_name])(compression_ratio=1.0 - keep)
            cache = DynamicCache()
            inputs = {"context_ids": torch.tensor([sample["context"]]),
                      "questions_ids": [torch.tensor([q]) for q in sample["questions"]]}
            t0 = time.perf_counter()
            row["texts"] = pipe._forward(inputs, max_new_tokens=sample["max_new"], press=press,
                                         cache=cache)
            row["seconds"] = time.perf_counter() - t0
            row["bytes"] = sum(l.keys.nbytes + l.values.nbytes for l in cache.layers)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        print(json.dumps(row), flush=True)
plain.cleanup()
"""


def _worker_env(pythonpath: str | None) -> dict[str, str]:
    """The worker's environment: `--kvpress-pythonpath` first on PYTHONPATH, the Hugging Face
    libraries offline (it reads the local GGUF only)."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


def _kvpress_command(python: str) -> list[str] | None:
    """`--kvpress-python` (a path or a command on PATH, with any arguments of its own) → its
    argv with the executable resolved, or None where there is no such executable."""
    words = shlex.split(python)
    found = shutil.which(words[0]) if words else None
    return None if found is None else [found, *words[1:]]


@dataclass
class Row:
    task: str
    method: str
    keep: float
    scores: list[float]
    bytes: list[int]
    error: str | None = None


def _kvpress_rows(
    args: argparse.Namespace, gguf: Path, samples: list[Sample], ids: list[dict]
) -> list[Row]:
    presses = [["none", 1.0]] + [[p, k] for p in args.presses for k in args.keeps]
    job = json.dumps({"presses": presses, "samples": ids})
    started = time.perf_counter()
    proc = subprocess.Popen(
        [*args.kvpress_command, "-c", WORKER, str(gguf.parent), gguf.name, args.device, args.dtype],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_worker_env(args.kvpress_pythonpath),
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(job)
    proc.stdin.close()
    rows: dict[tuple[str, str, float], Row] = {}
    for line in proc.stdout:
        r = json.loads(line)
        sample = samples[r["sample"]]
        method = "kvpress " + ("(no press)" if r["press"] == "none" else r["press"])
        row = rows.setdefault(
            (sample.task, method, r["keep"]), Row(sample.task, method, r["keep"], [], [])
        )
        if "error" in r:
            row.error = r["error"]
            print(
                f"[{time.perf_counter() - started:6.0f} s] {method} {r['keep']}: {r['error']}",
                file=sys.stderr,
            )
            continue
        texts = [answer_text(q, t) for q, t in zip(sample.queries, r["texts"], strict=True)]
        score = sum(query_score(q, t) for q, t in zip(sample.queries, texts, strict=True))
        row.scores.append(score / len(sample.queries))
        row.bytes.append(r["bytes"])
        print(
            f"[{time.perf_counter() - started:6.0f} s] {method} keep {r['keep']}: {sample.task} "
            f"#{sample.index} score {row.scores[-1]:.2f} ({r['seconds']:.0f} s)",
            file=sys.stderr,
        )
    if proc.wait() != 0:
        sys.exit(f"the kvpress worker failed (exit {proc.returncode})")
    return list(rows.values())


def _larql_rows(args: argparse.Namespace, model, samples: list[Sample]) -> list[Row]:
    ffn = build_ffn(model, "dense")
    runs = [("standard", 1.0)] + [(t, k) for t in args.engines for k in args.keeps]
    rows: dict[tuple[str, str, float], Row] = {}
    started = time.perf_counter()
    for template, keep in runs:
        for sample in samples:
            tokens = len(model.tokenizer.encode(sample.context))
            budget = max(2, round(keep * tokens))
            method = "larql " + _label(template)
            row = rows.setdefault(
                (sample.task, method, keep), Row(sample.task, method, keep, [], [])
            )
            try:
                spec = CATALOG.parse(template.format(keep=keep, budget=budget, half=budget // 2))
            except LarqlError as e:
                row.error = str(e)
                continue
            cell = score_sample(model, ffn, spec, sample)
            if cell.error:
                row.error = cell.error
                continue
            row.scores.append(cell.score)
            row.bytes.append(cell.memory_bytes)
            print(
                f"[{time.perf_counter() - started:6.0f} s] {spec.spec()}: {sample.task} "
                f"#{sample.index} score {cell.score:.2f}",
                file=sys.stderr,
            )
    return list(rows.values())


def _label(template: str) -> str:
    """A template's row name: the engine and the parameters it fixes (`kvzip:heads=adaptive`),
    not the ones filled per keep."""
    name, _, params = template.partition(":")
    fixed = [p for p in params.split(",") if p and "{" not in p]
    return name + (":" + ",".join(fixed) if fixed else "")


def _available(template: str) -> bool:
    name = template.split(":")[0]
    return name in {e.name for e in CATALOG.entries}


def _table(rows: list[Row]) -> str:
    lines = [
        "| task | method | keep | score | MiB after the context | samples |",
        "|---|---|---|---|---|---|",
    ]
    order = sorted(rows, key=lambda r: (r.task, -r.keep, r.method))
    for r in order:
        score = f"{sum(r.scores) / len(r.scores):.2f}" if r.scores else "—"
        mib = f"{sum(r.bytes) / len(r.bytes) / 2**20:.2f}" if r.bytes else "—"
        note = f" (error: {r.error[:80]})" if r.error and not r.scores else ""
        lines.append(
            f"| {r.task} | {r.method}{note} | {r.keep:g} | {score} | {mib} | {len(r.scores)} |"
        )
    summary: dict[tuple[str, float], list[float]] = {}
    for r in rows:
        summary.setdefault((r.method, r.keep), []).extend(r.scores)
    lines += ["", "| method | keep | score, all tasks |", "|---|---|---|"]
    for (method, keep), scores in sorted(summary.items(), key=lambda x: (-x[0][1], x[0][0])):
        shown = f"{sum(scores) / len(scores):.2f}" if scores else "—"
        lines.append(f"| {method} | {keep:g} | {shown} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a registry name or a .gguf")
    parser.add_argument("--quick", action="store_true", help="2 tasks, 512 tokens, keep 0.5")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--lengths", default="1024")
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keeps", default="0.5,0.25,0.1")
    parser.add_argument("--presses", default=",".join(PRESSES))
    parser.add_argument("--engines", default=";".join(ENGINES), help="larql spec templates")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N), both sides")
    parser.add_argument(
        "--dtype", default="float32", choices=DTYPES, help="both sides' weights and K/V"
    )
    parser.add_argument(
        "--kvpress-python",
        default=os.environ.get("KVPRESS_PY", str(DEFAULT_KVPRESS_PYTHON)),
        help="the Python that has kvpress: a path or a command on PATH",
    )
    parser.add_argument(
        "--kvpress-pythonpath",
        default=None,
        help="folder(s) put first on the kvpress Python's PYTHONPATH (a `pip install --target`)",
    )
    parser.add_argument("--json", action="store_true", help="the rows as JSON, not a table")
    args = parser.parse_args()
    args.kvpress_command = _kvpress_command(args.kvpress_python)
    if args.kvpress_command is None:
        print(f"no kvpress Python at {args.kvpress_python}; make it with: {INSTALL}")
        return
    if args.quick:
        args.tasks, args.lengths, args.samples, args.keeps = (
            "niah-single,niah-multikey",
            "512",
            1,
            "0.5",
        )
        args.presses = "snapkv"
    args.tasks = tuple(t for t in args.tasks.split(",") if t)
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        sys.exit(f"--tasks: unknown {', '.join(unknown)}; known: {', '.join(TASKS)}")
    args.keeps = [float(k) for k in args.keeps.split(",") if k]
    args.presses = [p for p in args.presses.split(",") if p]
    args.engines = [t for t in args.engines.split(";") if t and _available(t)]
    _, gguf = resolve_model_path(args.model)
    if gguf.is_dir():
        sys.exit(f"{args.model} is an HF directory; name its .gguf")
    try:
        model = load_model(args.model, dtype=args.dtype, device=args.device, weights="float")
    except LarqlError as e:
        sys.exit(f"{args.model}: {e}")
    lengths = tuple(int(n) for n in args.lengths.split(","))
    samples = generate_samples(model.tokenizer, args.tasks, lengths, args.samples, args.seed)
    ids = [
        {
            "context": model.tokenizer.encode(s.context),
            "questions": [
                model.tokenizer.encode(q.question, add_special_tokens=False) for q in s.queries
            ],
            "max_new": max(q.max_new_tokens for q in s.queries),
        }
        for s in samples
    ]
    rows = _larql_rows(args, model, samples) + _kvpress_rows(args, gguf, samples, ids)
    if args.json:
        print(json.dumps([vars(r) for r in rows], indent=2))
        return
    print(
        f"{model.name}, {len(samples)} samples ({', '.join(args.tasks)} × {args.lengths} "
        f"tokens × {args.samples}), seed {args.seed}, {args.device}, {args.dtype}"
    )
    print(_table(rows))


if __name__ == "__main__":
    main()
