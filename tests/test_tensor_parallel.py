"""Tensor parallelism (`larql.parallel`): a rank's share of the weights rebuilds the whole
model's products, the sizes that do not split a model are refused by name before anything
starts, every live engine gives one process's logits under two ranks (gloo, a tiny random
model), every tiny mixture of experts (each expert split by its width) decodes one process's
tokens under two, the default model's greedy tokens are one process's under three, and a rank
that dies ends the run instead of hanging it."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import tensor_parallel_ranks
from helpers import relative_error, teacher_forced
from larql.cli.app import app
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate
from larql.kv import parse_engine
from larql.models import Model, load_model
from larql.models.gguf_file import GgufFile
from larql.models.gguf_loader import gguf_block_rows
from larql.models.model import load_config
from larql.models.shard import (
    TensorParallelError,
    TensorShard,
    check_splits,
    shard_blocks,
    shard_config,
    shard_state,
    valid_sizes,
)
from larql.parallel.launch import free_port, run_ranks
from test_engine_compliance import LIVE_SPECS
from tiny_models import build_tiny_model, random_ids, rewrite_config


def test_the_default_model_splits_three_ways_or_not_at_all(smollm2: Model) -> None:
    assert valid_sizes(smollm2.config) == [1, 3]
    with pytest.raises(TensorParallelError, match=r"valid sizes: 1, 3"):
        check_splits(smollm2.config, 2)
    share = shard_config(smollm2.config, 3)
    assert (share.num_heads, share.num_kv_heads, share.intermediate_size) == (3, 1, 512)
    assert share.attn_scale == smollm2.config.attn_scale  # the head width's, not the count's


def test_valid_sizes_divide_every_layers_kv_heads(smollm2: Model) -> None:
    """A layer of its own K/V head count (Gemma 4's global layers) limits the sizes too."""
    layers = (replace(smollm2.config.layers[0], num_kv_heads=1), *smollm2.config.layers[1:])
    assert valid_sizes(replace(smollm2.config, layers=layers)) == [1]
    wider = replace(smollm2.config, num_heads=12, num_kv_heads=6, intermediate_size=1536)
    assert valid_sizes(wider) == [1, 2, 3, 6]


def test_a_group_of_one_loads_the_model_a_process_alone_does(tiny_models: dict[str, str]) -> None:
    """torchrun with one process: no shard on the model, so the step is the one-process step
    (CUDA graphs and fused layers take a sharded model's layers nowhere)."""
    alone = load_model(tiny_models["llama"])
    one = load_model(tiny_models["llama"], shard=TensorShard(0, 1))
    assert one.shard is None and one.config == alone.config
    for name, tensor in alone.weights.layers[0].__dict__.items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, getattr(one.weights.layers[0], name)), name


def test_run_refuses_a_size_that_does_not_divide_the_heads_before_starting() -> None:
    started = time.perf_counter()
    result = CliRunner().invoke(app, ["run", "Hi", "-n", "2", "--tensor-parallel", "2"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "valid sizes: 1, 3" in lines[0] and "Traceback" not in lines[0]
    assert time.perf_counter() - started < 30  # the header read, no model and no process


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--ffn-policy", "walk"], "--ffn-policy"),
        (["--save-state", "state-dir"], "--save-state"),
        (["--engine", "boundary-kv:archive=frames"], "writes files"),
        (["--engine", "apollo"], "apollo"),
    ],
)
def test_run_refuses_what_ranks_cannot_split_before_starting(
    args: list[str], named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "Hi", "-n", "2", "--tensor-parallel", "3", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0]
    assert not any(tmp_path.iterdir())  # nothing written, nothing started


@settings(max_examples=6, deadline=None)
@given(rank=st.integers(0, 2), rows=st.integers(1, 3))
def test_the_ranks_partial_products_sum_to_the_whole(smollm2: Model, rank: int, rows: int) -> None:
    """Layer 0 of the default model cut three ways: a rank's Q/K/V rows are its heads' rows of
    the whole projection, and the three ranks' output-projection and MLP partial products sum
    to the whole ones."""
    cfg, lw = smollm2.config, smollm2.weights.layers[0]
    q_dim, kv_dim = cfg.q_dim, cfg.kv_dim
    state = {
        "layers.0.wq": lw.wqkv[:q_dim],
        "layers.0.wk": lw.wqkv[q_dim : q_dim + kv_dim],
        "layers.0.wo": lw.wo,
        "layers.0.w_gate": lw.w_gate_up.chunk(2)[0],
        "layers.0.w_down": lw.w_down,
    }
    shares = [shard_state(cfg, state, r, 3) for r in range(3)]
    mine = shares[rank]
    heads = slice(rank * 3 * cfg.head_dim, (rank + 1) * 3 * cfg.head_dim)
    assert torch.equal(mine["layers.0.wq"], lw.wqkv[heads])
    kv = slice(q_dim + rank * cfg.head_dim, q_dim + (rank + 1) * cfg.head_dim)
    assert torch.equal(mine["layers.0.wk"], lw.wqkv[kv])
    g = torch.Generator().manual_seed(rank * 10 + rows)
    attn = torch.randn(rows, q_dim, generator=g, dtype=torch.float64)  # [S, q_dim]
    parts = [attn[:, r * q_dim // 3 : (r + 1) * q_dim // 3] for r in range(3)]
    summed = sum(p @ s["layers.0.wo"].double().T for p, s in zip(parts, shares, strict=True))
    assert relative_error(summed, attn @ lw.wo.double().T) < 1e-12
    x = torch.randn(rows, cfg.hidden_size, generator=g, dtype=torch.float64)
    act = [torch.nn.functional.silu(x @ s["layers.0.w_gate"].double().T) for s in shares]
    whole_act = torch.nn.functional.silu(x @ state["layers.0.w_gate"].double().T)
    assert torch.equal(torch.cat(act, dim=-1), whole_act)
    down = sum(a @ s["layers.0.w_down"].double().T for a, s in zip(act, shares, strict=True))
    assert relative_error(down, whole_act @ lw.w_down.double().T) < 1e-12


def test_block_matrices_are_cut_on_whole_blocks(smollm2_default: Model) -> None:
    """The default model's GGUF blocks, cut three ways: each rank's rows and columns are the
    whole matrix's (dequantised), so a rank's block products read one process's weights."""
    cfg = smollm2_default.config
    blocks = {
        name: rows
        for name, rows in gguf_block_rows(GgufFile(smollm2_default.source), cfg).items()
        if name.startswith("layers.0.")
    }
    for rank in range(3):
        share = shard_blocks(cfg, blocks, rank, 3)
        assert set(share) == set(blocks)
        for name, part in share.items():
            whole = blocks[name].dequantize()
            if name.endswith(("wo", "w_down")):
                width = whole.shape[1] // 3
                expected = whole[:, rank * width : (rank + 1) * width]
            else:
                height = whole.shape[0] // 3
                expected = whole[rank * height : (rank + 1) * height]
            assert torch.equal(part.dequantize(), expected), name


LARQL = [sys.executable, "-m", "larql"]

# beside the Llama every engine runs on: biases on Q/K/V (Qwen2), soft-caps and post-norms
# (Gemma 2), K/V shared across layers, v-norm and per-layer inputs (Gemma 4)
OTHER_ARCHITECTURES = ["qwen2", "gemma2", "gemma4_shared"]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny random models whose 4 query / 2 K/V heads and 80-wide MLP split two ways."""
    pytest.importorskip("transformers")
    directories = {}
    for arch in ["llama", *OTHER_ARCHITECTURES]:
        directory = tmp_path_factory.mktemp(f"tp-{arch}")
        build_tiny_model(arch, directory)
        directories[arch] = str(directory)
    return directories


@pytest.mark.slow
def test_every_live_engine_gives_one_process_logits_under_two_ranks(
    tiny_models: dict[str, str], tmp_path: Path
) -> None:
    ids, prompt_len = random_ids(20, seed=7), 10
    runs = {tiny_models["llama"]: LIVE_SPECS}
    runs.update({tiny_models[arch]: ["standard"] for arch in OTHER_ARCHITECTURES})
    out = tmp_path / "ranks.pt"
    options = dict(runs=runs, ids=ids, prompt_len=prompt_len, out=str(out))
    assert run_ranks(2, tensor_parallel_ranks.engines_logits, options) == 0
    ranks = torch.load(out)
    for directory, specs in runs.items():
        whole = load_model(directory, dtype=torch.float64)
        for spec in specs:
            reference = teacher_forced(whole, spec, ids, prompt_len)
            # a quantiser codes float32 values: a rank's shard sums its products in another
            # order, which on some CPUs moves a coordinate on a level boundary by one level
            quantises = "turbo-quant" in spec or "kv-quant" in spec  # alone or composed
            bound = 1e-6 if quantises else 1e-9
            assert relative_error(ranks[directory, spec], reference) <= bound, (directory, spec)
    # a sampled run (no seed: each rank's own draws would differ) fed both ranks rank 0's tokens
    sampled = [torch.load(f"{out}.sampled.{rank}") for rank in range(2)]
    assert len(sampled[0]) == 12 and sampled[0] == sampled[1]


@pytest.mark.slow
def test_bench_times_every_engine_on_two_ranks(tiny_models: dict[str, str], tmp_path: Path) -> None:
    """`larql bench --tensor-parallel 2` on the tiny Llama: one report (rank 0's), a row per
    engine and none failed, the engines' state no more than one process's."""
    engines = "standard;turbo-quant:bits=4;markov-rs"
    args = [
        "bench",
        "-m",
        tiny_models["llama"],
        "--engine",
        engines,
        "--prompt-tokens",
        "8",
        "-n",
        "2",
    ]
    args += ["--repeats", "1", "--warmup", "0", "--output", "json", "-q"]
    one = CliRunner().invoke(app, args)  # one process: this one
    two = subprocess.run(
        [*LARQL, *args, "--tensor-parallel", "2"], capture_output=True, text=True, timeout=300
    )
    assert one.exit_code == 0, one.output
    assert two.returncode == 0, two.stderr
    alone, ranks = json.loads(one.stdout)["rows"], json.loads(two.stdout)["rows"]
    assert [r["spec"] for r in ranks] == [r["spec"] for r in alone]
    for whole, share in zip(alone, ranks, strict=True):
        assert share["error"] is None
        assert 0 < share["memory"]["state"] <= whole["memory"]["state"]
    # standard keeps K/V of its rank's heads alone (markov-rs keeps the whole residual too)
    assert ranks[0]["memory"]["state"] * 2 == alone[0]["memory"]["state"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc's thread names")
def test_a_torchrun_rank_ends_its_groups_threads_when_it_leaves(tmp_path: Path) -> None:
    """Two ranks in torchrun's environment (no torchrun: the variables it sets) join, reduce
    and leave: after `leave_group` no gloo thread is left, so none is still running (and
    holding a collective's tensors) when the interpreter exits, which aborted the process."""
    tests = str(Path(__file__).parent)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    script = "import sys, tensor_parallel_ranks as r; r.join_reduce_and_leave(sys.argv[1])"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path / f"{rank}.json")],
            env={**env, "RANK": str(rank)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        errors = [rank.communicate(timeout=120)[1] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    for rank, error in zip(ranks, errors, strict=True):
        assert rank.returncode == 0, error
    for rank in range(2):
        threads = json.loads((tmp_path / f"{rank}.json").read_text())
        assert threads["before"] and threads["left"]  # (the group ran on gloo's threads)
        assert threads["after"] == []


def _torchrun_node(port: int, args: list[str]) -> subprocess.Popen[str]:
    """One node of the two-host form of docs/SCALE.md (torchrun, c10d rendezvous), one rank on
    it; in a session of its own, so that what it started ends with it."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    launcher += ["--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    launcher += ["--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "larql"]
    return subprocess.Popen(
        [*launcher, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
def test_two_torchrun_nodes_print_one_process_tokens_and_both_exit_cleanly(
    tmp_path: Path,
) -> None:
    """`larql run --tensor-parallel 2` as two torchrun nodes on this machine: the node that got
    rank 0 prints one process's tokens, and both nodes exit 0 within the bound. A rank whose
    group outlived its command aborted at the interpreter's exit (`terminate called`), and the
    other node's agent then waited 300 s for it."""
    build_tiny_model("llama", tmp_path)
    args = ["run", "-m", str(tmp_path), "w5 w17 w40 w8 w61", "-n", "8", "--output", "json"]
    port = free_port()
    nodes = [_torchrun_node(port, [*args, "--tensor-parallel", "2"]) for _ in range(2)]
    try:
        one = CliRunner().invoke(app, args)  # one process: this one, while the nodes start
        ended = [node.communicate(timeout=90) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:  # (timed out: its agent and rank end with it)
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    assert one.exit_code == 0, one.output
    for node, (_, err) in zip(nodes, ended, strict=True):
        assert node.returncode == 0, err
        assert "terminate called" not in err and "SIGABRT" not in err, err
    printed = [json.loads(out) for out, _ in ended if out.strip()]
    assert len(printed) == 1  # rank 0's node alone writes
    alone = json.loads(one.stdout)
    same = ["prompt_tokens", "token_ids", "text", "finish_reason"]
    assert {k: printed[0][k] for k in same} == {k: alone[k] for k in same}
    assert len(alone["token_ids"]) == 8


def _close(one: object, other: object) -> bool:
    """Two JSON reports equal: every count and label exactly, every float up to the order of
    the ranks' sums: 1e-3 relative, or 1e-6 nats for the near-zero differences of nearly equal
    log-probabilities (a quantiser's log-perplexity ratio of 5e-5 moves by 2e-7 when the order
    of a sum tips a coordinate into the next code)."""
    if isinstance(one, dict) and isinstance(other, dict):
        return one.keys() == other.keys() and all(_close(one[k], other[k]) for k in one)
    if isinstance(one, list) and isinstance(other, list):
        return len(one) == len(other) and all(_close(a, b) for a, b in zip(one, other, strict=True))
    if isinstance(one, float) and isinstance(other, float):
        both_nan = math.isnan(one) and math.isnan(other)
        return both_nan or math.isclose(one, other, rel_tol=1e-3, abs_tol=1e-6)
    return one == other


@pytest.mark.slow
def test_accuracy_under_two_ranks_reports_what_one_process_does(
    tiny_models: dict[str, str], tmp_path: Path
) -> None:
    """`larql accuracy --tensor-parallel 2` on the tiny Llama (its own words as the fidelity
    text): rank 0's tables are one process's, and its JSON too — the state bytes are the
    ranks' sum, one process's bytes, and the floats one process's up to the order of sums."""
    words = torch.randint(3, 96, (160,), generator=torch.Generator().manual_seed(3))
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"w{i}" for i in words.tolist()))
    args = ["accuracy", "-m", tiny_models["llama"], "--text", str(text), "-q"]
    args += ["--engine", "standard;standard:window=8;turbo-quant:bits=4", "--no-conflict"]
    args += ["--parametric-n", "2", "--needle-max-tokens", "64", "--positions", "16"]
    runs = []
    for extra in (["--threads", "1"], ["--tensor-parallel", "2"]):
        out = tmp_path / f"{extra[0]}.json"
        done = subprocess.run(
            [*LARQL, *args, *extra, "--output-file", str(out)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0 and not done.stderr, done.stderr
        runs.append((done.stdout, json.loads(out.read_text())))
    (one_text, one), (two_text, two) = runs
    assert _close(one, two)
    fidelity = {row["spec"]: row for row in two["fidelity"]}
    assert fidelity["standard"]["memory_bytes"] > fidelity["standard:window=8"]["memory_bytes"]
    # the exact engines' rows of the fidelity table and the whole score table, to the digit
    same = [line for line in one_text.splitlines() if "turbo-quant" not in line]
    assert same == [line for line in two_text.splitlines() if "turbo-quant" not in line]


@pytest.mark.long  # ~2 min on a loaded 2-core machine: three ranks over the suite's steps
def test_accuracy_on_the_default_model_under_three_ranks_prints_one_process_table(
    tmp_path: Path,
) -> None:
    args = ["accuracy", "--engine", "standard;standard:window=8", "--no-conflict", "-q"]
    args += ["--parametric-n", "1", "--needle-max-tokens", "64", "--positions", "8"]
    args += ["--weights", "float"]
    one = subprocess.run([*LARQL, *args], capture_output=True, text=True, timeout=600)
    three = subprocess.run(
        [*LARQL, *args, "--tensor-parallel", "3"], capture_output=True, text=True, timeout=600
    )
    assert one.returncode == 0 and three.returncode == 0, three.stderr
    assert three.stdout == one.stdout and "standard:window=8" in one.stdout


def test_accuracy_refuses_workers_and_other_ffns_with_tensor_parallel() -> None:
    both = CliRunner().invoke(app, ["accuracy", "--workers", "2", "--tensor-parallel", "3"])
    assert both.exit_code == 2
    assert both.stderr.strip() == "error: give --workers or --tensor-parallel, not both"
    walk = CliRunner().invoke(app, ["accuracy", "--ffn-policy", "walk", "--tensor-parallel", "3"])
    assert walk.exit_code == 2 and "--ffn-policy" in walk.stderr
    assert len(walk.stderr.strip().splitlines()) == 1
    odd = CliRunner().invoke(app, ["accuracy", "--tensor-parallel", "2"])
    assert odd.exit_code == 2 and "valid sizes: 1, 3" in odd.stderr


@pytest.mark.long  # ~100 s on a loaded 2-core machine (three ranks, two weight modes)
def test_the_default_model_under_three_ranks_decodes_one_process_tokens(tmp_path: Path) -> None:
    """The default model, three ranks, float weights and `larql run`'s GGUF blocks: one
    process's greedy tokens for standard, turbo-quant and markov-rs. The exact engines' logits
    on float weights are one process's up to the order of the ranks' sums; turbo-quant's codes
    and the blocks' int16 input codes round at steps, where that order may tip a value into the
    next step."""
    specs, prompt, n = (
        ["standard", "turbo-quant:bits=4", "markov-rs"],
        "The capital of France is",
        8,
    )
    modes = ["float", "auto"]
    out = tmp_path / "ranks.pt"
    options = dict(models=["smollm2-135m"], weights=modes, specs=specs, prompt=prompt, n=n, out=out)
    assert run_ranks(3, tensor_parallel_ranks.greedy_tokens, options) == 0
    ranks = {(w, spec): got for (_, w, spec), got in torch.load(out).items()}
    for weights in modes:
        model = load_model("smollm2-135m", weights=weights)
        ids = model.tokenizer.encode(prompt)
        for spec in specs:
            engine = parse_engine(spec).build(model)
            tokens = generate(engine, model, DenseFfn(model), ids, n, stop_ids=frozenset()).tokens
            logits = teacher_forced(model, spec, ids + tokens, len(ids))
            assert ranks[weights, spec][0] == tokens, (weights, spec)
            exact = weights == "float" and spec != "turbo-quant:bits=4"
            bound = 1e-5 if exact else 1e-3
            assert relative_error(ranks[weights, spec][1], logits) <= bound, (weights, spec)


# every tiny mixture of experts (4 experts, 2 per token): Mixtral's 80 wide; Qwen2-MoE's 40
# wide, a 64-wide shared expert with its gate and a dense layer; Qwen3-MoE's; GPT-OSS's with
# biases and a clamped SwiGLU; Gemma 4's 24 wide beside a dense MLP, routed on the residual
MOE_ARCHITECTURES = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "gemma4_moe"]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    pytest.importorskip("transformers")
    directories = {}
    for arch in MOE_ARCHITECTURES:
        directory = tmp_path_factory.mktemp(f"tp-{arch}")
        build_tiny_model(arch, directory)
        directories[arch] = str(directory)
    return directories


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_the_ranks_expert_shares_sum_to_the_whole_block(
    arch: str, moe_models: dict[str, str]
) -> None:
    """Each of two ranks holds half of every expert's (and the shared expert's) width, the
    router whole, an expert's output bias on rank 0 alone; the ranks' outputs of every layer's
    FFN (and of Gemma 4's experts beside its MLP) sum to one process's, for a decode row (each
    pair gathers its expert) and for a prefill (each chosen expert over its rows)."""
    whole = load_model(moe_models[arch], dtype=torch.float64)
    ranks = [
        load_model(moe_models[arch], dtype=torch.float64, shard=TensorShard(rank, 2))
        for rank in range(2)
    ]
    routing, share = whole.config.experts, ranks[1].config.experts
    assert routing is not None and share is not None and routing.expert_width is not None
    assert share.expert_width == routing.expert_width // 2
    experts, mine = whole.weights.layers[0].experts, ranks[1].weights.layers[0].experts
    assert experts is not None and mine is not None
    assert torch.equal(mine.router, experts.router)
    assert torch.equal(mine.down, experts.down[:, :, routing.expert_width // 2 :])
    if experts.down_bias is not None:  # GPT-OSS: added once, by rank 0
        assert torch.equal(ranks[0].weights.layers[0].experts.down_bias, experts.down_bias)
        assert not mine.down_bias.any()
    g = torch.Generator().manual_seed(5)
    for rows in (1, 6):
        x = torch.randn(rows, whole.config.hidden_size, generator=g, dtype=torch.float64)
        for layer, lw in enumerate(whole.weights.layers):
            parts = [DenseFfn(m).forward(layer, x) for m in ranks]  # [S, H] each
            assert relative_error(sum(parts), DenseFfn(whole).forward(layer, x)) < 1e-12
            if lw.experts_norm is not None:
                parts = [DenseFfn(m).parallel_experts(layer, x) for m in ranks]
                reference = DenseFfn(whole).parallel_experts(layer, x)
                assert relative_error(sum(parts), reference) < 1e-12


@pytest.mark.slow
def test_mixtures_of_experts_decode_one_process_tokens_under_two_ranks(
    moe_models: dict[str, str], tmp_path: Path
) -> None:
    """Every tiny mixture of experts under two ranks (float32): one process's greedy tokens
    for `standard` and `markov-rs`, and its teacher-forced logits up to the order of the
    ranks' sums."""
    specs, prompt, n = ["standard", "markov-rs"], "w5 w17 w40 w3 w77 w21 w9", 8
    models = [moe_models[arch] for arch in MOE_ARCHITECTURES]
    out = tmp_path / "ranks.pt"
    options = dict(models=models, weights=["float"], specs=specs, prompt=prompt, n=n, out=out)
    assert run_ranks(2, tensor_parallel_ranks.greedy_tokens, options) == 0
    ranks = torch.load(out)
    for directory in models:
        model = load_model(directory, weights="float")
        ids = model.tokenizer.encode(prompt)
        for spec in specs:
            engine = parse_engine(spec).build(model)
            tokens = generate(engine, model, DenseFfn(model), ids, n, stop_ids=frozenset()).tokens
            logits = teacher_forced(model, spec, ids + tokens, len(ids))
            got_tokens, got_logits = ranks[directory, "float", spec]
            assert got_tokens == tokens, (directory, spec)
            assert relative_error(got_logits, logits) <= 1e-4, (directory, spec)


def test_an_expert_width_that_does_not_split_is_named_with_the_valid_sizes(
    moe_models: dict[str, str], tmp_path: Path
) -> None:
    """Qwen2-MoE's widths all split two ways; a Qwen3-MoE whose experts are 25 wide splits no
    way, and `larql run` says so in one line, naming that width, before loading any weight."""
    config = load_config(moe_models["qwen2_moe"])
    assert valid_sizes(config) == [1, 2]
    assert shard_config(config, 2).experts == replace(
        config.experts, expert_width=20, shared_width=32
    )
    odd = tmp_path / "odd"
    odd.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (odd / name).write_bytes((Path(moe_models["qwen3_moe"]) / name).read_bytes())
    rewrite_config(odd, moe_intermediate_size=25)  # and no weights at all
    assert valid_sizes(load_config(str(odd))) == [1]
    result = CliRunner().invoke(
        app, ["run", "-m", str(odd), "w5 w6", "-n", "2", "--tensor-parallel", "2"]
    )
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0]
    assert "MLP width 80, expert width 25) into equal shares; valid sizes: 1" in lines[0]


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_run_instead_of_hanging_it() -> None:
    started = time.perf_counter()
    status = run_ranks(2, tensor_parallel_ranks.one_rank_dies, {}, timeout=timedelta(seconds=60))
    assert status != 0
    assert time.perf_counter() - started < 45  # well before the collectives' timeout


@pytest.mark.slow
def test_a_rank_that_stops_answering_ends_the_run_at_the_collectives_timeout(
    capfd: pytest.CaptureFixture[str],
) -> None:
    started = time.perf_counter()
    options = {"stall_s": 120}
    status = run_ranks(
        2, tensor_parallel_ranks.one_rank_stalls, options, timeout=timedelta(seconds=3)
    )
    assert status == 2  # rank 0's typed error, written by it
    assert time.perf_counter() - started < 60  # the timeout, not the stalled rank's two minutes
    assert "all-reduce failed" in capfd.readouterr().err
