"""`larql bench` on the real default model with tiny token counts: JSON schema, the arithmetic
behind every derived figure, the percentile rule, and honest gaps (no ratio without a measure).
No test asserts a speed."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from larql.cli.app import app
from larql.harness.bench.engine_bench import BenchSettings, EngineRow, bench_engine, bench_engines
from larql.harness.bench.machine import peak_above_resident
from larql.harness.bench.stats import StepStats, nearest_rank
from larql.harness.bench.step_timer import StepTimer
from larql.inference.ffn import DenseFfn
from larql.inference.memory import MemoryBreakdown
from larql.kv import parse_engine
from larql.models import Model, load_model

ROW_KEYS = {
    "spec",
    "label",
    "depth",
    "prompt_tokens",
    "prefill_ms",
    "decode_ms",
    "fwd_ms",
    "head_ms",
    "tok_s",
    "tok_s_runs",
    "memory",
    "context_tokens",
    "bytes_per_token",
    "fp16_full_bytes",
    "ratio_vs_fp16_full",
    "achieved_gbs",
    "bandwidth_share",
    "peak_working_bytes",
    "held_bytes",
    "stages",
    "decode_path",
    "error",
    "vs_hf",
    "backend",
    "ms_per_tok",
    "tok_per_s",
    "wire_bytes_per_tok",
    "n_steps",
    "note",
}
META_KEYS = {
    "schema",
    "timestamp",
    "model",
    "dtype",
    "device",
    "threads",
    "torch",
    "git_commit",
    "text",
    "prompt_hashes",
    "new_tokens",
    "warmup",
    "repeats",
    "ffn",
    "copy_bandwidth_gbs",
    "method",
    "rows",
    "hf",
    "batch_rows",
    "concurrent_rows",
    "prefix_rows",
}


def test_nearest_rank_percentiles() -> None:
    samples = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert nearest_rank(samples, 50) == 3.0  # index floor(5·0.5) = 2 of [1, 2, 3, 4, 5]
    assert nearest_rank(samples, 99) == 5.0  # index floor(4.95) = 4
    assert nearest_rank(samples, 0) == 1.0
    assert nearest_rank([7.0], 99) == 7.0
    stats = StepStats.of([1.0, 2.0, 3.0, 10.0])
    assert (stats.mean, stats.p50, stats.p99, stats.n) == (4.0, 3.0, 10.0, 4)


def test_derived_figures_follow_their_definitions() -> None:
    row = EngineRow(spec="x", label="x", depth=0, prompt_tokens=10)
    assert row.ratio_vs_fp16_full is None and row.bytes_per_token is None  # nothing measured
    row.memory = MemoryBreakdown(hot=600, cold=300, derivative=100, reserved=500)
    row.context_tokens = 20
    row.fp16_full_bytes = 4000
    row.tok_s = 10.0
    row.weight_read_bytes = 9000
    row.bandwidth_gbs = 1e-3
    assert row.bytes_per_token == 50.0
    assert row.ratio_vs_fp16_full == 0.25
    assert row.achieved_gbs == pytest.approx((9000 + 1000) * 10 / 1e9)
    assert row.bandwidth_share == pytest.approx(0.1)
    row.memory = MemoryBreakdown()
    assert row.ratio_vs_fp16_full is None  # an engine holding nothing gets no ratio


def test_bench_engine_measures_whole_tokens(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode("The capital of France is")
    settings = BenchSettings(new_tokens=3, warmup=1, repeats=2)
    row = bench_engine(smollm2, DenseFfn(smollm2), parse_engine("standard"), ids, settings)
    assert row.error is None
    assert row.step is not None and row.step.n == 6  # 3 kept steps × 2 repeats
    assert len(row.tok_s_runs) == 2
    assert row.tok_s == pytest.approx(sum(row.tok_s_runs) / 2)  # the median of two: their mean
    assert row.fwd_ms + row.head_ms == pytest.approx(row.step.mean, rel=1e-6)
    assert row.context_tokens == len(ids) + 4
    assert row.fp16_full_bytes == smollm2.config.kv_bytes_per_token(2) * row.context_tokens
    assert row.memory.total > 0 and row.ratio_vs_fp16_full > 0


class RecordingKind:
    """An engine kind that logs every build: one build is one timed run."""

    def __init__(self, spec: str, log: list[str]) -> None:
        self.inner, self.log = parse_engine(spec), log
        self.built: list[weakref.ref] = []

    def spec(self) -> str:
        return self.inner.spec()

    def build(self, model: Model, profiling: bool = False):
        self.log.append(self.spec())
        engine = self.inner.build(model, profiling=profiling)
        self.built.append(weakref.ref(engine))
        return engine


@pytest.mark.slow
def test_engines_are_timed_in_interleaved_rounds(smollm2: Model) -> None:
    """Round i runs every engine once, so run i of each happened in the same stretch of time;
    an engine that fails stops being run but leaves the others' rounds intact."""
    ids = smollm2.tokenizer.encode("The capital of France is")
    log: list[str] = []
    kinds = [RecordingKind(spec, log) for spec in ("standard", "markov-rs", "no-cache")]
    rows = bench_engines(smollm2, DenseFfn(smollm2), kinds, ids, BenchSettings(2, 0, 3))
    assert log == ["standard", "markov-rs", "no-cache"] * 3
    assert [len(row.tok_s_runs) for row in rows] == [3, 3, 3]
    assert all(row.error is None and row.step.n == 6 for row in rows)
    log.clear()
    failing = [RecordingKind(spec, log) for spec in ("standard", "markov-rs")]
    rows = bench_engines(smollm2, DenseFfn(smollm2), failing, [], BenchSettings(1, 0, 2))
    assert log == ["standard", "markov-rs"]  # each failed in round 1 and was not run again
    assert all(row.error.startswith("EmptyPrompt") for row in rows)


def test_rounds_do_not_keep_engines_alive(smollm2: Model) -> None:
    """An engine's state is dropped after its run: engines timed in rounds must not hold each
    other's caches (on CUDA that inflated every later engine's peak memory)."""
    ids = smollm2.tokenizer.encode("The capital of France is")
    kinds = [RecordingKind(spec, []) for spec in ("standard", "markov-rs")]
    rows = bench_engines(smollm2, DenseFfn(smollm2), kinds, ids, BenchSettings(2, 0, 2))
    gc.collect()
    assert all(ref() is None for kind in kinds for ref in kind.built)
    assert all(
        row.memory.total > 0 and row.label.startswith(row.spec.split(":")[0]) for row in rows
    )
    assert all(row.peak_working_bytes is None for row in rows)  # the CPU keeps no peak
    assert all(row.held_bytes is None for row in rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_peak_above_resident_leaves_out_what_was_allocated_before() -> None:
    device = torch.device("cuda")
    resident = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    with peak_above_resident(device) as peak:
        scratch = torch.empty(16 << 20, dtype=torch.uint8, device=device)
        kept = torch.empty(4 << 20, dtype=torch.uint8, device=device)
        del scratch
        held = peak.held_now()
    assert peak.bytes == 20 << 20 and held == 4 << 20
    del resident, kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_evicting_session_holds_less_cuda_memory_than_the_full_cache() -> None:
    """What eviction frees is really freed: the rows it drops leave the allocator."""
    model = load_model("smollm2-135m", device="cuda", dtype=torch.bfloat16)
    ids = model.tokenizer.encode(" ".join(["Every rule here is written down once."] * 120))
    settings = BenchSettings(4, 0, 1)
    held = {}
    for spec in ("standard", "keydiff:keep=0.25", "keydiff:keep=0.25+turbo-quant:bits=4"):
        row = bench_engine(model, DenseFfn(model), parse_engine(spec), ids, settings)
        assert row.error is None and row.held_bytes is not None
        held[spec] = row.held_bytes
    assert held["keydiff:keep=0.25"] <= 0.35 * held["standard"]
    assert held["keydiff:keep=0.25+turbo-quant:bits=4"] < 0.5 * held["keydiff:keep=0.25"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_step_timer_splits_on_the_gpu_timeline_without_a_sync() -> None:
    """The forward is ~20 ms of GPU work queued in microseconds: the host clock at split() has
    not seen it, the stream events have; the whole token waits for it at the token read."""
    device = torch.device("cuda")
    timer = StepTimer(device)
    cycles = 20_000_000  # ~10-20 ms at GPU clocks
    for _ in range(2):  # the first pass loads the kernels (CUDA lazy loading)
        torch.cuda.synchronize()
        timer.start()
        torch.cuda._sleep(cycles)
        timer.split()
        picked = torch.argmax(torch.ones(8, device=device))
        timer.end()
        int(picked)
        took = timer.stop()
    assert took.forward_ms > 5 and took.head_ms < took.forward_ms / 5
    assert took.whole_ms >= 0.9 * (took.forward_ms + took.head_ms)


def test_engine_errors_become_rows_not_crashes(smollm2: Model) -> None:
    row = bench_engine(
        smollm2, DenseFfn(smollm2), parse_engine("standard"), [], BenchSettings(1, 0, 1)
    )
    assert row.error == "EmptyPrompt: engine called with empty prompt"
    assert row.as_dict()["tok_s"] is None


def test_cli_json_schema_and_depths(tmp_path: Path) -> None:
    out_file = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--engine",
            "standard;no-cache",
            "-n",
            "2",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--depths",
            "0,12",
            "--output",
            "json",
            "--output-file",
            str(out_file),
            "--plot",
            str(plot),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == META_KEYS
    assert data == json.loads(out_file.read_text())
    assert data["schema"] == "larql.bench/1" and data["copy_bandwidth_gbs"] > 0
    assert [(r["spec"], r["depth"], r["prompt_tokens"]) for r in data["rows"]] == [
        ("standard", 0, 1),
        ("no-cache", 0, 1),
        ("standard", 12, 12),
        ("no-cache", 12, 12),
    ]
    for row in data["rows"]:
        assert set(row) == ROW_KEYS
        assert row["vs_hf"] is None  # no peer was measured
        assert row["memory"]["total"] > 0
        # the reference format's fields, consistent with ours
        assert row["backend"] == row["label"] and row["tok_per_s"] == row["tok_s"]
        assert row["ms_per_tok"]["p50"] == row["decode_ms"]["p50"] and row["n_steps"] == 2
        assert row["wire_bytes_per_tok"] == 0  # the FFN is local
        assert "fwd=" in row["note"] and "hot=" in row["note"]
    assert plot.stat().st_size > 1000


def test_cli_rejects_unknown_engines_and_bad_options() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "--engine", "standard;warp-drive"])
    assert result.exit_code == 2 and "supported: standard" in result.stderr
    for options in (
        ["--prompt-tokens", "8", "--prompt", "hi"],
        ["--prompt-tokens", "8", "--depths", "8"],
    ):
        result = runner.invoke(app, ["bench", *options])
        assert result.exit_code == 2
        assert "give one of --prompt-tokens, --depths, --prompt" in result.stderr
    result = runner.invoke(app, ["bench", "--prompt-tokens", "0"])
    assert result.exit_code == 2 and "--prompt-tokens must be ≥ 1" in result.stderr
    result = runner.invoke(app, ["bench", "--depths", "1,x"])
    assert result.exit_code == 2 and "--depths" in result.stderr
    for bad in ("0,4", "2,x"):
        result = runner.invoke(app, ["bench", "--batch", bad])
        assert result.exit_code == 2 and "--batch" in result.stderr


def test_cli_concurrent_rows_time_threads_stepping_alone() -> None:
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--engine",
            "standard;no-cache",
            "-n",
            "2",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--prompt-tokens",
            "8",
            "--concurrent",
            "2",
            "--output",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["concurrent_rows"]
    assert [(r["spec"], r["concurrent"]) for r in rows] == [("standard", 2), ("no-cache", 2)]
    for row in rows:
        assert row["error"] is None and row["tok_s"] > 0 and row["ms_per_token"] > 0
    bad = CliRunner().invoke(app, ["bench", "--concurrent", "0"])
    assert bad.exit_code == 2 and "--concurrent must be ≥ 1" in bad.stderr


def test_cli_batch_rows_time_sessions_decoding_at_once() -> None:
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--engine",
            "standard;no-cache",
            "-n",
            "2",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--prompt-tokens",
            "8",
            "--batch",
            "1,3",
            "--output",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = {(r["spec"], r["batch"]): r for r in json.loads(result.stdout)["batch_rows"]}
    assert set(rows) == {("standard", 1), ("standard", 3), ("no-cache", 1), ("no-cache", 3)}
    assert rows["standard", 3]["batched"] is True  # one forward pass per step
    assert rows["no-cache", 3]["batched"] is False  # steps in turn
    assert rows["standard", 1]["batched"] is False
    for row in rows.values():
        assert row["error"] is None and row["tok_s"] > 0 and row["memory_per_session"] > 0
        # aggregate = B tokens per step
        assert row["tok_s"] == pytest.approx(row["batch"] * 1000 / row["ms_per_token"])


def test_vs_hf_adds_a_peer_row_and_ratios(tmp_path: Path) -> None:
    """On a tiny HF directory: transformers reading the default model's GGUF takes most of a
    minute here, and the oracle tests (test_real_models.py) already load it that way."""
    pytest.importorskip("transformers")
    from tiny_models import build_tiny_model

    build_tiny_model("llama", tmp_path)
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "-m",
            str(tmp_path),
            "--engine",
            "standard",
            "-n",
            "2",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--prompt-tokens",
            "8",
            "--vs-hf",
            "--output",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    peer = data["hf"]["8"]  # keyed by depth: the 8 tokens of context
    assert peer["tok_s"] > 0 and peer["cache_bytes"] > 0 and peer["prompt_tokens"] == 8
    row = data["rows"][0]
    assert row["vs_hf"] == pytest.approx(row["tok_s"] / peer["tok_s"])


def test_the_device_is_warmed_up_before_any_row_is_timed(smollm2: Model) -> None:
    """One untimed short run of the first engine comes before the timed rounds, so that the
    first row does not carry the process's one-time start (seconds on a CUDA host)."""
    from larql.harness.bench.run import run_bench

    ids = smollm2.tokenizer.encode("The capital of France is")
    log: list[str] = []
    kinds = [RecordingKind(spec, log) for spec in ("markov-rs", "standard")]
    report = run_bench(smollm2, DenseFfn(smollm2), kinds, [(0, ids)], BenchSettings(2, 0, 1))
    assert log == ["markov-rs", "markov-rs", "standard"]  # the warm-up, then the round
    assert [len(row.tok_s_runs) for row in report.rows] == [1, 1]


def test_cli_shared_prefix_rows_time_a_question_from_the_cache() -> None:
    args = ["bench", "--engine", "standard;turbo-quant:bits=4", "-n", "1", "--warmup", "0"]
    args += ["--repeats", "1", "--prompt-tokens", "4", "--shared-prefix", "96", "--output", "json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["prefix_rows"]
    assert [r["spec"] for r in rows] == ["standard", "turbo-quant"]
    for row in rows:
        assert row["error"] is None and row["cached_tokens"] >= 96
        assert row["cold_ms"] > 0 and row["warm_ms"] > 0 and row["cache_bytes"] > 0
    bad = CliRunner().invoke(app, ["bench", "--shared-prefix", "9000"])
    assert bad.exit_code == 2 and "context" in bad.stderr
