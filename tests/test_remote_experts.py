"""A mixture-of-experts model's experts on shards (`larql serve --ffn-only --experts A-B`, the
`remote-experts` FFN backend, `--moe-shards`): the same logits as the local experts over f32,
the engines the spec refuses, coverage and failures as typed errors."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from typer.testing import CliRunner

from larql.cli.app import app
from larql.inference.errors import BackendFailure, BackendUnavailable
from larql.inference.ffn import DenseFfn, build_ffn
from larql.inference.ffn.spec import MalformedBackend
from larql.inference.ffn.wire import MEDIA_TYPES, encode_request
from larql.inference.generation import teacher_forced_logits
from larql.kv import parse_engine
from larql.models import Model, load_model
from larql.server.ffn_shard import ShardLayersError, create_ffn_app, start_shard
from tiny_models import build_tiny_model, random_ids

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2-MoE: 4 experts (2 per token), a shared expert, layer 1 dense."""
    directory = tmp_path_factory.mktemp("remote-moe")
    build_tiny_model("qwen2_moe", directory)
    return directory


@pytest.fixture(scope="module")
def moe(moe_dir: Path) -> Model:
    return load_model(str(moe_dir))


@pytest.fixture(scope="module")
def shards(moe: Model) -> Iterator[str]:
    """Experts 0-2 on one shard, expert 3 on another → the `shards=` value."""
    with (
        start_shard(create_ffn_app(moe, experts=(0, 2))) as low,
        start_shard(create_ffn_app(moe, experts=(3, 3))) as high,
    ):
        yield f"0-2={low.url}|3-3={high.url}"


def test_remote_experts_give_the_local_logits(moe: Model, shards: str) -> None:
    """Prefill (each expert its rows) and decode steps (one request per shard) over f32."""
    _remote_equals_local(moe, shards)


def _remote_equals_local(model: Model, shards: str) -> None:
    """Teacher-forced logits with the experts on `shards` = with them local (f32), and the
    shards were asked (wire bytes > 0)."""
    ids = random_ids(14)
    engine = parse_engine("standard")
    local = teacher_forced_logits(engine.build(model), model, DenseFfn(model), ids, 6)
    remote = build_ffn(model, f"remote-experts:shards={shards}")
    try:
        over = teacher_forced_logits(engine.build(model), model, remote, ids, 6)
        assert remote.wire_bytes() > 0
    finally:
        remote.close()
    assert (over - local).abs().max().item() < 1e-5


def test_experts_beside_the_mlp_on_shards(tmp_path: Path) -> None:
    """Gemma 4's experts (beside each layer's dense MLP, routed on the raw residual, their own
    norms) on two shards give the local logits, and the shards carry them (wire bytes > 0)."""
    build_tiny_model("gemma4_moe", tmp_path)
    model = load_model(str(tmp_path))
    with (
        start_shard(create_ffn_app(model, experts=(0, 1))) as low,
        start_shard(create_ffn_app(model, experts=(2, 3))) as high,
    ):
        _remote_equals_local(model, f"0-1={low.url}|2-3={high.url}")


@pytest.mark.parametrize("engine", ["no-cache", "apollo"])
def test_engines_the_spec_refuses(moe: Model, shards: str, engine: str) -> None:
    remote = build_ffn(moe, f"remote-experts:shards={shards}")
    try:
        with pytest.raises(BackendUnavailable, match=f"{engine} cannot run with remote experts"):
            parse_engine(engine).build(moe).prefill(moe, remote, random_ids(6))
    finally:
        remote.close()


def test_shards_must_cover_every_expert_once(moe: Model, shards: str) -> None:
    low = shards.split("|")[0]
    with pytest.raises(MalformedBackend, match="cover experts 0-3"):
        build_ffn(moe, f"remote-experts:shards={low}")


def test_a_shard_answers_only_for_its_experts(moe: Model, shards: str) -> None:
    url = shards.split("|")[1].split("=", 1)[1]  # serves expert 3 only
    x = torch.zeros(1, moe.config.hidden_size)
    unit = 0 * 4 + 1  # layer 0, expert 1
    response = httpx.post(
        url + "/v1/experts-ffn",
        content=encode_request([unit], x),
        headers={"Content-Type": MEDIA_TYPES["f32"]},
    )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "expert_not_served"
    dense_layer = 1 * 4 + 3  # layer 1 has no experts
    response = httpx.post(
        url + "/v1/experts-ffn",
        content=encode_request([dense_layer], x),
        headers={"Content-Type": MEDIA_TYPES["f32"]},
    )
    assert response.status_code == 422
    stats = httpx.get(url + "/v1/stats").json()
    assert (stats["experts"], stats["num_experts"]) == ([3, 3], 4)


def test_a_layer_shard_is_not_an_expert_shard(moe: Model) -> None:
    with start_shard(create_ffn_app(moe)) as server:
        remote = build_ffn(moe, f"remote-experts:shards=0-3={server.url}")
        try:
            with pytest.raises(BackendFailure, match="HTTP 404"):
                teacher_forced_logits(
                    parse_engine("standard").build(moe), moe, remote, random_ids(4), 2
                )
        finally:
            remote.close()


def test_a_dead_shard_is_a_typed_error_not_a_hang(moe: Model) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    remote = build_ffn(moe, f"remote-experts:shards=0-3=http://127.0.0.1:{port},timeout=2")
    try:
        with pytest.raises(BackendUnavailable, match="cannot be reached"):
            parse_engine("standard").build(moe).prefill(moe, remote, random_ids(4))
    finally:
        remote.close()


def test_expert_shards_need_a_model_with_experts(smollm2: Model) -> None:
    with pytest.raises(ShardLayersError, match="mixture-of-experts"):
        create_ffn_app(smollm2, experts=(0, 1))


def test_run_with_moe_shards_from_the_cli(moe_dir: Path, shards: str) -> None:
    runner = CliRunner()
    flag = shards.replace("|", ",")
    common = ["run", "w5 w6 w7 w8", "-m", str(moe_dir), "-n", "6", "--output", "json"]
    local = runner.invoke(app, common)
    remote = runner.invoke(app, [*common, "--moe-shards", flag, "--ffn-timeout-secs", "30"])
    assert local.exit_code == 0 and remote.exit_code == 0, remote.output
    tokens = [json.loads(r.stdout.strip().splitlines()[-1])["tokens"] for r in (local, remote)]
    assert tokens[0] == tokens[1]
    refused = runner.invoke(app, [*common, "--moe-shards", flag, "--engine", "no-cache"])
    assert refused.exit_code == 2 and "cannot run with remote experts" in refused.output
    bad = runner.invoke(app, [*common, "--moe-shards", "0-1"])
    assert bad.exit_code == 2 and "A-B=URL" in bad.output
