"""A bench run: every engine spec at every depth, plus the HF peer when asked, and the facts
about the machine the numbers came from."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from larql.errors import InvalidInput
from larql.harness.bench.batch_bench import BatchRow, bench_batches
from larql.harness.bench.concurrent_bench import ConcurrentRow, bench_concurrent
from larql.harness.bench.engine_bench import BenchSettings, EngineRow, bench_engines
from larql.harness.bench.hf_peer import PeerRow, bench_hf, load_hf_model
from larql.harness.bench.machine import copy_bandwidth_gbs, git_commit, ids_hash, sync
from larql.harness.bench.prefix_bench import (
    QUESTION_TOKENS,
    ROUND_STRIDE,
    PrefixRow,
    bench_prefix,
)
from larql.harness.contexts import context_ids
from larql.harness.workers import in_workers
from larql.inference.errors import EngineError
from larql.inference.ffn import FfnBackend, build_ffn
from larql.inference.generation import next_token_logits
from larql.inference.sampling import greedy_token
from larql.kv.catalog import CATALOG, parse_engine
from larql.kv.spec import EngineSpec
from larql.models.model import Model

SCHEMA = "larql.bench/1"

DEFAULT_CONTEXT = 128


def default_specs() -> list[str]:
    """Every engine as its catalog entry says a bench runs it (`Sweeps.bench`)."""
    return CATALOG.default_specs("bench")


def bench_prompts(
    model: Model,
    text: str,
    depths: list[int] | None = None,
    prompt: str | None = None,
    reserve: int = 0,
) -> list[tuple[int, list[int]]]:
    """(depth, prompt ids) pairs: `prompt`'s ids, or for each depth D, D tokens cut from `text`
    (a prefill needs at least one, so depth 0 is a one-token prompt); `depths` None or empty =
    the default context. Each must leave `reserve` tokens (warmup + timed steps) of context."""
    if prompt is not None:
        ids = model.tokenizer.encode(prompt)
        if not ids:
            raise InvalidInput("the bench prompt encodes to no tokens")
        prompts = [(len(ids), ids)]
    else:
        prompts = [(d, context_ids(model, max(d, 1), text)) for d in depths or [DEFAULT_CONTEXT]]
    limit = model.config.max_positions
    for d, ids in prompts:
        if len(ids) + reserve > limit:
            raise InvalidInput(
                f"depth {d}: {len(ids)} + {reserve} tokens exceed the model's context of {limit}"
            )
    return prompts


@dataclass
class BenchReport:
    meta: dict[str, Any]
    rows: list[EngineRow] = field(default_factory=list)
    peers: dict[int, PeerRow] = field(default_factory=dict)  # depth → HF row
    batch_rows: list[BatchRow] = field(default_factory=list)  # --batch
    concurrent_rows: list[ConcurrentRow] = field(default_factory=list)  # --concurrent
    prefix_rows: list[PrefixRow] = field(default_factory=list)  # --shared-prefix

    def peer_ratio(self, row: EngineRow) -> float | None:
        peer = self.peers.get(row.depth)
        if peer is None or row.tok_s is None or not peer.tok_s:
            return None
        return row.tok_s / peer.tok_s

    def as_dict(self) -> dict[str, Any]:
        rows = []
        for row in self.rows:
            d = row.as_dict()
            d["vs_hf"] = self.peer_ratio(row)
            rows.append(d)
        return {
            **self.meta,
            "rows": rows,
            "hf": {str(depth): peer.as_dict() for depth, peer in self.peers.items()},
            "batch_rows": [row.as_dict() for row in self.batch_rows],
            "concurrent_rows": [row.as_dict() for row in self.concurrent_rows],
            "prefix_rows": [row.as_dict() for row in self.prefix_rows],
        }


Progress = Callable[[str], None]


WARM_UP_TOKENS = 16


def warm_up(model: Model, ffn: FfnBackend, kind: EngineSpec, prompt_ids: list[int]) -> None:
    """An untimed short prefill and two decode steps before any row is timed, so that no
    engine's row carries the process's one-time start (on CUDA the context, the BLAS handles and
    the first kernels' loading: seconds on an H200 host)."""
    with torch.inference_mode():
        try:
            engine = kind.build(model)
            hidden = engine.prefill(model, ffn, prompt_ids[:WARM_UP_TOKENS])
            for _ in range(2):
                token = int(greedy_token(next_token_logits(model, hidden)))
                hidden = engine.decode_step(model, ffn, token)
        except EngineError:
            pass  # the row itself reports the engine's error
    sync(model.device)


def run_bench(
    model: Model,
    ffn: FfnBackend,
    kinds: list[EngineSpec],
    prompts: list[tuple[int, list[int]]],
    settings: BenchSettings,
    vs_hf: bool = False,
    text_label: str = "",
    progress: Progress | None = None,
    batches: list[int] | None = None,
    concurrent: int | None = None,
    shared_prefix: tuple[int, str] | None = None,
) -> BenchReport:
    """`prompts`: (depth, prompt ids) pairs; every engine runs at every depth, and with
    `batches` also as that many sessions decoding at once. `shared_prefix` (N, text): also
    each engine's time to first token for a second question about a document of N tokens cut
    from the text, from the prefix cache, against the first's."""
    bandwidth = copy_bandwidth_gbs(model.device.type)
    report = BenchReport(
        meta={
            "schema": SCHEMA,
            "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "model": model.name,
            "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "git_commit": git_commit(),
            "text": text_label,
            "prompt_hashes": {str(d): ids_hash(ids) for d, ids in prompts},
            "new_tokens": settings.new_tokens,
            "warmup": settings.warmup,
            "repeats": settings.repeats,
            "ffn": ffn.name,
            "copy_bandwidth_gbs": bandwidth,
            "method": (
                "whole token = forward + logits + argmax as the generation loop runs it (no "
                "sync between; on CUDA the forward/head split comes from stream events); "
                "prefill includes the first pick; "
                "engines interleaved: every engine once per round; "
                "median tok/s over rounds, percentiles nearest-rank over all kept steps; "
                "memory = engine tensors after decode (+ growth reserve); ratio = state bytes / an "
                "fp16 full cache at the same length; "
                "achieved GB/s = (weights read per token + engine state) × tok/s"
            ),
        }
    )
    if kinds and prompts:
        warm_up(model, ffn, kinds[0], prompts[0][1])
    for depth, ids in prompts:
        if progress:
            names = ", ".join(kind.spec() for kind in kinds)
            progress(f"{names} @ depth {depth} ({settings.repeats} interleaved rounds)")
        report.rows += bench_engines(model, ffn, kinds, ids, settings, depth, bandwidth)
        if batches:
            if progress:
                progress(f"batches {batches} @ depth {depth}")
            report.batch_rows += bench_batches(model, ffn, kinds, ids, settings, depth, batches)
        if concurrent:
            if progress:
                progress(f"{concurrent} concurrent sessions @ depth {depth}")
            report.concurrent_rows += bench_concurrent(
                model, ffn, kinds, ids, settings, depth, concurrent
            )
    if shared_prefix is not None:
        shared, text = shared_prefix
        if progress:
            progress(f"shared prefix of {shared} tokens ({settings.repeats} rounds)")
        needed = shared + 2 * QUESTION_TOKENS + ROUND_STRIDE * (settings.repeats + 1)
        ids = context_ids(model, needed, text)
        report.prefix_rows = bench_prefix(model, ffn, kinds, ids, shared, settings.repeats)
    if vs_hf:
        hf_model = load_hf_model(model)
        for depth, ids in prompts:
            if progress:
                progress(f"hf-transformers @ depth {depth}")
            report.peers[depth] = bench_hf(hf_model, ids, settings.new_tokens, settings.repeats)
    return report


@dataclass(frozen=True)
class BenchJob:
    """What a bench worker runs: `run_bench` on its share of the engines (spec texts)."""

    specs: list[str]
    ffn: str
    prompts: list[tuple[int, list[int]]]
    settings: BenchSettings
    vs_hf: bool
    text_label: str
    batches: list[int] | None
    concurrent: int | None
    shared_prefix: tuple[int, str] | None


def _bench_job(model: Model, job: BenchJob) -> BenchReport:
    router = build_ffn(model, job.ffn)
    try:
        return run_bench(
            model,
            router,
            [parse_engine(s) for s in job.specs],
            job.prompts,
            job.settings,
            job.vs_hf,
            job.text_label,
            None,
            job.batches,
            job.concurrent,
            job.shared_prefix,
        )
    finally:
        router.close()


def run_bench_in_workers(
    model: Model, job: BenchJob, workers: int, progress: Progress | None = None
) -> BenchReport:
    """`run_bench` with the engines spread over `workers` processes (`harness.workers`, each on
    its own slice of the cores, or on CUDA its own GPU where there are enough): each times its
    share, interleaved as one process interleaves them (the HF peer in the first), and the rows
    are joined in one process's order. Timings taken while the other workers run are not those
    of one process."""
    seen = set()
    for spec in job.specs:
        if spec in seen:
            raise InvalidInput(f"{spec} is listed twice; with workers, list each engine once")
        seen.add(spec)
    count = len(job.specs)
    groups = [list(range(w, count, workers)) for w in range(workers) if w < count]
    jobs = [
        dataclasses.replace(job, specs=[job.specs[k] for k in group], vs_hf=job.vs_hf and w == 0)
        for w, group in enumerate(groups)
    ]

    def finished(i: int, _: BenchReport) -> None:
        if progress:
            progress(f"worker {i + 1} of {len(jobs)}: {', '.join(jobs[i].specs)}")

    parts = in_workers(model, _bench_job, jobs, len(jobs), finished, split_cores=True)
    batch = len(job.batches or [])
    report = BenchReport(
        meta={
            **parts[0].meta,
            "workers": [
                {"engines": j.specs, "device": p.meta["device"], "threads": p.meta["threads"]}
                for j, p in zip(jobs, parts, strict=True)
            ],
        },
        rows=_in_order([p.rows for p in parts], groups, 1),
        peers=parts[0].peers,
        batch_rows=_in_order([p.batch_rows for p in parts], groups, batch),
        concurrent_rows=_in_order([p.concurrent_rows for p in parts], groups, 1),
        prefix_rows=_in_order([p.prefix_rows for p in parts], groups, 1),
    )
    return report


Row = TypeVar("Row")


def _in_order(parts: list[list[Row]], groups: list[list[int]], per_kind: int) -> list[Row]:
    """Each worker's rows — per depth, its engines in order, `per_kind` rows each — joined in
    one process's order: by depth, then by the engine's place in the whole list."""
    keyed = []
    for rows, group in zip(parts, groups, strict=True):
        for j, row in enumerate(rows):
            block, within = divmod(j, len(group) * per_kind)
            kind, sub = divmod(within, per_kind)
            keyed.append(((block, group[kind], sub), row))
    return [row for _, row in sorted(keyed, key=lambda pair: pair[0])]
