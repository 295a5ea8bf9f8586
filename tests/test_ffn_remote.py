"""FFN shards over HTTP: the wire format, real shard servers on 127.0.0.1 (ephemeral ports) and
the `remote-walk` client — exact over f32, measured over f16 and i8, split across two shards,
typed errors when a shard is gone, misbehaves or is sent a bad request."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI
from fastapi.responses import Response
from hypothesis import given, settings
from hypothesis import strategies as st

from larql.inference.errors import BackendFailure, BackendUnavailable
from larql.inference.ffn import DenseFfn, build_ffn
from larql.inference.ffn.remote import RemoteWalkFfn
from larql.inference.ffn.wire import (
    F16,
    F32,
    I8,
    MEDIA_TYPES,
    WireFormatError,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from larql.inference.generation import generate, teacher_forced_logits
from larql.kv import parse_engine
from larql.models import Model
from larql.server.ffn_shard import create_ffn_app, start_shard

TEXT = (
    "The capital of France is Paris. The capital of Germany is Berlin. Water boils at 100 "
    "degrees Celsius at sea level, and the"
)
PROMPT = "The capital of France is"
H = 576


@pytest.fixture(scope="module")
def shard(smollm2: Model) -> Iterator[str]:
    with start_shard(create_ffn_app(smollm2)) as server:
        yield server.url


@pytest.fixture(scope="module")
def halves(smollm2: Model) -> Iterator[tuple[str, str]]:
    with (
        start_shard(create_ffn_app(smollm2, range(0, 15))) as low,
        start_shard(create_ffn_app(smollm2, range(15, 30))) as high,
    ):
        yield low.url, high.url


def stats(url: str) -> dict:
    return httpx.get(url + "/v1/stats").json()


def greedy(model: Model, ffn, n: int = 6) -> list[int]:
    ids = model.tokenizer.encode(PROMPT)
    return generate(
        parse_engine("standard").build(model), model, ffn, ids, n, stop_ids=frozenset()
    ).tokens


# ---------------------------------------------------------------------------- wire format


@pytest.mark.parametrize("wire", [F32, F16, I8])
@pytest.mark.parametrize("batched", [False, True])
def test_response_round_trip(wire: str, batched: bool) -> None:
    out = np.random.default_rng(0).normal(size=(3, H)).astype(np.float32) * 10
    results = [(4, out), (9, out * 2)] if batched else [(4, out)]
    body = encode_response(results, 1.5, wire, batched)
    decoded, latency = decode_response(body, wire, H, batched)
    assert latency == 1.5 and [layer for layer, _ in decoded] == [r[0] for r in results]
    for (_, got), (_, sent) in zip(decoded, results, strict=True):
        bound = {F32: 0.0, F16: 1e-3 * np.abs(sent).max(), I8: np.abs(sent).max() / 254 + 1e-6}
        assert np.abs(got - sent).max() <= bound[wire]
    assert len(encode_response([(4, out)], 0.0, F16, False)) == 12 + 3 * H * 2
    assert len(encode_response([(4, out)], 0.0, I8, False)) == 12 + 3 * (8 + H)


def test_request_round_trip() -> None:
    x = torch.randn(2, H, dtype=torch.float64)
    single = decode_request(encode_request(7, x, top_k=100), H)
    assert single.layers == (7,) and not single.batched and single.top_k == 100
    assert np.array_equal(single.residual, x.float().numpy())
    batch = decode_request(encode_request([1, 2, 3], x), H)
    assert batch.layers == (1, 2, 3) and batch.batched and batch.seq_len == 2


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\x00" * 15,
        struct.pack("<IIII", 0, 0, 1, 0),  # seq_len 0
        struct.pack("<IIII", 0, 1, 0, 0) + b"\x00" * 4 * H,  # not full_output
        struct.pack("<IIII", 0, 2, 1, 0) + b"\x00" * 4 * H,  # 1 row of data for 2 rows
        struct.pack("<IIII", 0, 1, 1, 0) + b"\x00" * 3,
        struct.pack("<II", 0xFFFFFFFF, 0) + b"\x00" * 12,  # empty batch
        struct.pack("<II", 0xFFFFFFFF, 5) + b"\x00" * 12,  # truncated batch header
        encode_request([3, 4, 3], torch.zeros(1, H)),  # a repeated layer
    ],
)
def test_malformed_requests_are_typed(body: bytes) -> None:
    with pytest.raises(WireFormatError):
        decode_request(body, H)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.sampled_from([F32, F16, I8]), st.booleans())
def test_any_bytes_decode_or_raise_a_typed_error(body: bytes, wire: str, batched: bool) -> None:
    with contextlib.suppress(WireFormatError):
        decode_request(body, 4)
    with contextlib.suppress(WireFormatError):
        decode_response(body, wire, 4, batched)


# ---------------------------------------------------------------------------- generation


@pytest.mark.slow
def test_every_layer_remote_over_f32_is_exactly_dense(smollm2: Model, shard: str) -> None:
    before = stats(shard).get("layer_calls", 0)
    remote = build_ffn(smollm2, f"remote-walk:endpoint={shard}")
    assert greedy(smollm2, remote) == greedy(smollm2, DenseFfn(smollm2))
    assert stats(shard)["layer_calls"] - before == 30 * 6  # the prefill + 5 decode steps
    ids = smollm2.tokenizer.encode(TEXT)[:12]
    engine = parse_engine("standard")
    local = teacher_forced_logits(engine.build(smollm2), smollm2, DenseFfn(smollm2), ids, 4)
    over = teacher_forced_logits(engine.build(smollm2), smollm2, remote, ids, 4)
    assert torch.equal(local, over)
    remote.close()


@pytest.fixture(scope="module")
def dense_logits(smollm2: Model) -> torch.Tensor:
    """The dense FFN's teacher-forced logits over TEXT after 4 tokens: [N, V]."""
    ids = smollm2.tokenizer.encode(TEXT)
    engine = parse_engine("standard").build(smollm2)
    return teacher_forced_logits(engine, smollm2, DenseFfn(smollm2), ids, 4)


@pytest.mark.parametrize(("wire", "max_mean_kl"), [(F16, 1e-4), (I8, 0.5)])
@pytest.mark.slow
def test_lossy_wires_report_their_kl(
    smollm2: Model, shard: str, dense_logits: torch.Tensor, wire: str, max_mean_kl: float
) -> None:
    ids = smollm2.tokenizer.encode(TEXT)
    engine = parse_engine("standard")
    dense = dense_logits
    remote = build_ffn(smollm2, f"remote-walk:endpoint={shard},wire={wire}")
    over = teacher_forced_logits(engine.build(smollm2), smollm2, remote, ids, 4)
    remote.close()
    log_p, log_q = torch.log_softmax(dense.double(), -1), torch.log_softmax(over.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    agree = (dense.argmax(-1) == over.argmax(-1)).double().mean().item()
    print(
        f"wire={wire}: KL(dense‖remote) mean {kl.mean():.3g} max {kl.max():.3g} nats, "
        f"top-1 agreement {agree:.3f} over {len(kl)} positions"
    )
    assert 0 < kl.mean().item() < max_mean_kl


def test_two_shards_split_the_layers(smollm2: Model, halves: tuple[str, str]) -> None:
    low, high = halves
    policy = (
        f"{{remote-walk:endpoint={low}}}@layers=0-14;{{remote-walk:endpoint={high}}}@layers=15-29"
    )
    router = build_ffn(smollm2, policy)
    assert router.backends[14] is not router.backends[15]
    assert greedy(smollm2, router, 4) == greedy(smollm2, DenseFfn(smollm2), 4)
    assert stats(low)["layers"] == [0, 14] and stats(high)["layers"] == [15, 29]
    assert stats(low)["layer_calls"] == stats(high)["layer_calls"] == 15 * 4
    router.close()
    wrong = build_ffn(smollm2, f"remote-walk:endpoint={low}")  # layer 15 is not on that shard
    with pytest.raises(BackendFailure, match="layer 15 is not served by this shard"):
        greedy(smollm2, wrong, 2)
    wrong.close()


def test_batched_request_computes_every_listed_layer(smollm2: Model, shard: str) -> None:
    client = RemoteWalkFfn(shard, hidden_size=H)
    x = torch.randn(2, H)
    outs = client.forward_layers([3, 4, 29], x)
    dense = DenseFfn(smollm2)
    assert sorted(outs) == [3, 4, 29]
    assert all(torch.equal(outs[layer], dense.forward(layer, x)) for layer in outs)
    f16 = RemoteWalkFfn(shard, wire=F16, hidden_size=H).forward_layers([5, 6], x)
    assert (f16[5] - dense.forward(5, x)).abs().max() < 1e-2 * dense.forward(5, x).abs().max()
    client.close()


def test_json_fallback(smollm2: Model, shard: str) -> None:
    x = torch.randn(2, H)
    dense = DenseFfn(smollm2)
    single = httpx.post(
        shard + "/v1/walk-ffn",
        json={"layer": 3, "seq_len": 2, "residual": x.ravel().tolist(), "full_output": True},
    ).json()
    assert single["layer"] == 3 and single["seq_len"] == 2
    assert torch.equal(torch.tensor(single["output"]).view(2, H), dense.forward(3, x))
    batch = httpx.post(
        shard + "/v1/walk-ffn", json={"layers": [1, 2], "residual": x[0].tolist()}
    ).json()
    assert [r["layer"] for r in batch["results"]] == [1, 2]
    # a JSON request may still ask for a binary answer
    binary = httpx.post(
        shard + "/v1/walk-ffn",
        json={"layer": 3, "residual": x[0].tolist()},
        headers={"Accept": MEDIA_TYPES[F32]},
    )
    assert binary.headers["content-type"] == MEDIA_TYPES[F32]
    ((_, out),) = decode_response(binary.content, F32, H, False)[0]
    assert np.array_equal(out, dense.forward(3, x[:1]).numpy())


def test_health_and_stats(shard: str) -> None:
    assert httpx.get(shard + "/health").json() == {"status": "ok"}
    data = stats(shard)
    assert data["hidden_size"] == H and data["num_layers"] == 30 and data["layers"] == [0, 29]
    assert data["wire"] == [F32, F16, I8]


# ---------------------------------------------------------------------------- bad requests


def _binary(layer: int, rows: int, width: int, flags: int = 1) -> bytes:
    return struct.pack("<IIII", layer, rows, flags, 0) + b"\x00" * 4 * rows * width


BAD_REQUESTS = [
    ("short body", {"content": b"abc"}, 400, "malformed_body"),
    ("wrong hidden size", {"content": _binary(0, 1, H - 1)}, 422, "wrong_hidden_size"),
    ("rows do not split", {"content": _binary(0, 3, H)[:-4]}, 400, "malformed_body"),
    ("not full output", {"content": _binary(0, 1, H, flags=0)}, 400, "malformed_body"),
    ("layer out of range", {"content": _binary(30, 1, H)}, 422, "layer_not_served"),
    ("huge layer id", {"content": _binary(2**32 - 2, 1, H)}, 422, "layer_not_served"),
    (
        "batch with a bad layer",
        {
            "content": struct.pack("<III", 0xFFFFFFFF, 2, 1)
            + struct.pack("<I", 31)
            + _binary(0, 1, H)[4:]
        },
        422,
        "layer_not_served",
    ),
    (
        "invalid JSON",
        {"content": b"{nope", "headers": {"Content-Type": "application/json"}},
        400,
        "malformed_body",
    ),
    ("JSON without layer", {"json": {"residual": [0.0] * H}}, 400, "malformed_body"),
    (
        "JSON wrong hidden size",
        {"json": {"layer": 1, "residual": [0.0] * 5}},
        422,
        "wrong_hidden_size",
    ),
    (
        "JSON layer as string",
        {"json": {"layer": "1", "residual": [0.0] * H}},
        400,
        "malformed_body",
    ),
    (
        "JSON residual of strings",
        {"json": {"layer": 1, "residual": ["a"] * H}},
        400,
        "malformed_body",
    ),
    ("JSON array body", {"json": [1, 2]}, 400, "malformed_body"),
    (
        "text body",
        {"content": b"hi", "headers": {"Content-Type": "text/plain"}},
        415,
        "unsupported_media_type",
    ),
    (
        "unacceptable Accept",
        {"content": _binary(0, 1, H), "headers": {"Accept": "text/html"}},
        406,
        "not_acceptable",
    ),
    ("too large", {"content": _binary(0, 9000, H)}, 413, "too_large"),
    (
        "repeated layer ids",
        {"content": encode_request([0] * 4096, torch.zeros(1, H))},
        400,
        "malformed_body",
    ),
    (
        "JSON repeated layer ids",
        {"json": {"layers": [2, 2], "residual": [0.0] * H}},
        400,
        "malformed_body",
    ),
    (
        "JSON rows declared past the body",
        {"json": {"layer": 1, "seq_len": 3, "residual": [0.0] * 2 * H}},
        422,
        "wrong_hidden_size",
    ),
    (
        "JSON number past f32",
        {"json": {"layer": 1, "residual": [10**400] * H}},
        400,
        "malformed_body",
    ),
]


@pytest.mark.parametrize(
    ("case", "kwargs", "status", "code"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_requests_are_4xx_with_a_json_error(
    shard: str, case: str, kwargs: dict, status: int, code: str
) -> None:
    response = httpx.post(shard + "/v1/walk-ffn", **kwargs)
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == code and error["message"]
    assert httpx.get(shard + "/health").status_code == 200


def test_a_batch_is_answered_with_what_it_declares(smollm2: Model, shard: str) -> None:
    """The issue's probe — 4,096 copies of one layer id in a 0.03 MB body — is refused naming
    the id, in a short error, not answered with 4,096 outputs; a batch of every layer once is
    answered with exactly the declared layers × rows × hidden values."""
    repeated = encode_request([7] * 2048 + [9] * 2048, torch.zeros(3, H))
    refused = httpx.post(shard + "/v1/walk-ffn", content=repeated)
    assert refused.status_code == 400 and len(refused.content) < 1000
    assert "repeats layer ids 7, 9" in refused.json()["error"]["message"]
    rows, layers = 3, list(range(30))
    request = encode_request(layers, torch.randn(rows, H))
    answer = httpx.post(shard + "/v1/walk-ffn", content=request)
    assert answer.status_code == 200
    assert len(answer.content) == 12 + len(layers) * (12 + rows * H * 4)
    assert len(answer.content) < len(layers) * len(request)  # at most the served layers' worth
    assert RemoteWalkFfn(shard, hidden_size=H).forward_layers(
        [4, 4, 5], torch.zeros(1, H)
    ).keys() == {4, 5}


def test_a_shard_reads_no_more_than_its_limits(smollm2: Model) -> None:
    """More rows than the shard takes are 413; so is a chunked body (no Content-Length) past
    its body limit — answered while the body is still coming, never read to its end."""
    app = create_ffn_app(smollm2)
    app.state.shard.max_rows, app.state.shard.max_body = 4, 64 * H
    with start_shard(app) as server:
        rows = httpx.post(server.url + "/v1/walk-ffn", content=_binary(0, 5, H))
        assert rows.status_code == 413 and "declares 5 rows" in rows.json()["error"]["message"]
        assert httpx.post(server.url + "/v1/walk-ffn", content=_binary(0, 4, H)).status_code == 200
        url = urlsplit(server.url)
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            sock.sendall(
                b"POST /v1/walk-ffn HTTP/1.1\r\nHost: shard\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            chunk = b"\x00" * 4 * H
            for _ in range(70):  # past 64 rows' worth, and never the closing empty chunk
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            assert sock.recv(4096).startswith(b"HTTP/1.1 413")


# ---------------------------------------------------------------------------- client errors


def test_nothing_listening_is_backend_unavailable() -> None:
    with start_shard(FastAPI()) as server:
        url = server.url  # after the block the port is free again
    client = RemoteWalkFfn(url, hidden_size=H, connect_timeout_s=2)
    with pytest.raises(BackendUnavailable, match="cannot be reached") as raised:
        client.forward(0, torch.zeros(1, H))
    assert raised.value.recoverable and client.stats.retries == 1


def _misbehaving_app() -> FastAPI:
    app = FastAPI()

    @app.post("/garbage/v1/walk-ffn")
    async def garbage() -> Response:
        return Response(b"\x01\x02\x03", media_type=MEDIA_TYPES[F32])

    @app.post("/wrong-type/v1/walk-ffn")
    async def wrong_type() -> Response:
        return Response(b"{}", media_type="application/json")

    @app.post("/wrong-layer/v1/walk-ffn")
    async def wrong_layer() -> Response:
        out = np.zeros((1, H), dtype=np.float32)
        return Response(encode_response([(9, out)], 0.0, F32, False), media_type=MEDIA_TYPES[F32])

    @app.post("/fails/v1/walk-ffn")
    async def fails() -> Response:
        return Response(b"boom", status_code=500)

    return app


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/garbage", "malformed response"),
        ("/wrong-type", "answered 'application/json'"),
        ("/wrong-layer", "answered layers [9]"),
        ("/fails", "HTTP 500: boom"),
    ],
)
def test_a_misbehaving_shard_is_backend_failure(path: str, message: str) -> None:
    with start_shard(_misbehaving_app()) as server:
        client = RemoteWalkFfn(server.url + path, hidden_size=H)
        with pytest.raises(BackendFailure, match=re.escape(message)):
            client.forward(0, torch.zeros(1, H))
        client.close()


def test_a_reset_connection_is_retried_once(smollm2: Model, shard: str) -> None:
    client = RemoteWalkFfn(shard, hidden_size=H)
    real = client._client.request
    resets = iter([httpx.RemoteProtocolError("Server disconnected")])

    def flaky(*args, **kwargs):
        error = next(resets, None)
        if error is not None:
            raise error
        return real(*args, **kwargs)

    client._client.request = flaky  # type: ignore[method-assign]
    x = torch.randn(1, H)
    assert torch.equal(client.forward(2, x), DenseFfn(smollm2).forward(2, x))
    assert client.stats.retries == 1
    resets = iter([httpx.ReadError("reset"), httpx.ReadError("reset again")])
    with pytest.raises(BackendUnavailable, match="ReadError"):
        client.forward(2, x)
    client.close()


# ---------------------------------------------------------------------------- a shard dies


SHARD_PROCESS = """
import torch
torch.set_num_threads(1)
from larql.models import load_model
from larql.server.ffn_shard import run_ffn_shard
run_ffn_shard(load_model("smollm2-135m"), None, "127.0.0.1", 0)
"""


def _start(argv: list[str]) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        argv, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert process.stderr is not None
    for line in process.stderr:
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            return process, found[1]
    process.kill()
    raise AssertionError(f"the shard process exited with {process.wait()}")


def _finishes(target, seconds: float = 60) -> BaseException | None:
    """Run target in a thread; fail the test if it hangs. → the exception it raised."""
    outcome: list[BaseException | None] = [None]

    def run() -> None:
        try:
            target()
        except BaseException as e:  # handed back to the test
            outcome[0] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the client hung on a dead shard"
    return outcome[0]


@pytest.mark.slow
def test_a_shard_killed_mid_generation_ends_with_a_typed_error(smollm2: Model) -> None:
    process, url = _start([sys.executable, "-c", SHARD_PROCESS])
    try:
        # stopped (accepts connections, never answers): the read timeout ends the call
        process.send_signal(signal.SIGSTOP)
        slow = build_ffn(smollm2, f"remote-walk:endpoint={url}")
        for backend in {id(b): b for b in slow.backends}.values():
            backend._timeout = httpx.Timeout(1.0, connect=1.0)  # type: ignore[attr-defined]
            backend._client.timeout = backend._timeout  # type: ignore[attr-defined]
        error = _finishes(lambda: greedy(smollm2, slow, 2))
        assert isinstance(error, BackendUnavailable), error
        assert "did not answer in time" in str(error)
        process.send_signal(signal.SIGCONT)
        slow.close()

        # killed after the first token: the next decode step fails, it does not hang
        remote = build_ffn(smollm2, f"remote-walk:endpoint={url}")
        ids = smollm2.tokenizer.encode(PROMPT)
        seen: list[int] = []

        def kill_after_first(token: int) -> None:
            seen.append(token)
            process.kill()
            process.wait()

        error = _finishes(
            lambda: generate(
                parse_engine("standard").build(smollm2),
                smollm2,
                remote,
                ids,
                8,
                on_token=kill_after_first,
            )
        )
        assert seen == greedy(smollm2, DenseFfn(smollm2), 1)
        assert isinstance(error, BackendUnavailable), error
        assert url in str(error) and "cannot be reached" in str(error)
        remote.close()
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.kill()
        process.wait()


def _serve_has_ffn_only() -> bool:
    try:
        from larql.cli import serve_cmd
    except ImportError:
        return False
    return "ffn_only" in inspect.signature(serve_cmd.serve).parameters


@pytest.mark.slow
@pytest.mark.skipif(not _serve_has_ffn_only(), reason="larql serve --ffn-only is not there yet")
def test_larql_serve_ffn_only_serves_a_layer_range() -> None:
    larql = os.path.join(os.path.dirname(sys.executable), "larql")
    process, url = _start([larql, "serve", "--ffn-only", "--layers", "0-14", "--port", "0"])
    try:
        assert url.startswith("http://127.0.0.1:")
        assert stats(url)["layers"] == [0, 14]
        response = httpx.post(url + "/v1/walk-ffn", content=_binary(20, 1, H))
        assert response.status_code == 422
        assert json.loads(response.text)["error"]["code"] == "layer_not_served"
        x = torch.randn(1, H)
        out = RemoteWalkFfn(url, hidden_size=H).forward(14, x)
        assert out.shape == (1, H) and torch.isfinite(out).all()
    finally:
        process.kill()
        process.wait()


def test_bench_reports_the_wire_bytes_per_token(smollm2: Model, shard: str) -> None:
    """30 layers a step, each a request of one f32 row and its f32 answer (plus framing)."""
    from larql.harness.bench.engine_bench import BenchSettings, bench_engine

    remote = build_ffn(smollm2, f"remote-walk:endpoint={shard}")
    try:
        ids = smollm2.tokenizer.encode(PROMPT)
        settings = BenchSettings(new_tokens=2, warmup=1, repeats=1)
        row = bench_engine(smollm2, remote, parse_engine("standard"), ids, settings, len(ids), 1.0)
    finally:
        remote.close()
    payload = 30 * 2 * H * 4  # the row out and back, per layer
    assert payload <= row.wire_bytes_per_tok < 1.5 * payload
    assert row.as_dict()["wire_bytes_per_tok"] == row.wire_bytes_per_tok


def test_ffn_timeout_secs_ends_a_run_on_a_silent_shard() -> None:
    """A shard that accepts connections and never answers: --ffn-timeout-secs bounds the wait
    and the run ends with a typed one-line error."""
    import time

    from typer.testing import CliRunner

    from larql.cli.app import app

    with contextlib.closing(__import__("socket").socket()) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshakes; nobody reads
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        result = CliRunner().invoke(
            app, ["run", PROMPT, "-n", "1", "--ffn", url, "--ffn-timeout-secs", "0.5"]
        )
        took = time.monotonic() - t0
    assert result.exit_code != 0 and "did not answer in time" in result.stderr
    assert "read 0.5s" in result.stderr and "Traceback" not in result.output
    assert took < 60  # bounded by the timeout (and its retries), never a hang
    misplaced = CliRunner().invoke(app, ["run", PROMPT, "--ffn-timeout-secs", "5"])
    assert misplaced.exit_code == 2 and "applies to --ffn URL" in misplaced.stderr


def test_the_client_probes_the_shard_and_settles_the_wire(
    smollm2: Model, shard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the first request: /v1/stats once; without wire= the best wire both sides speak,
    a wire asked for that the shard lacks is refused, and another model's shard is refused."""
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(3))
    plain = RemoteWalkFfn(shard, hidden_size=H)
    dense = DenseFfn(smollm2).forward(4, x)
    assert torch.allclose(plain.forward(4, x), dense, atol=1e-5) and plain.wire == F32
    assert plain.stats.requests == 2  # the probe, then the layer
    plain.close()

    def stats_saying(**info):  # type: ignore[no-untyped-def]
        return lambda self: {"wire": ["f16", "i8"], "hidden_size": H, **info}

    monkeypatch.setattr(RemoteWalkFfn, "shard_stats", stats_saying())
    negotiated = RemoteWalkFfn(shard, hidden_size=H)
    out = negotiated.forward(4, x)
    assert negotiated.wire == F16 and torch.allclose(out, dense, rtol=1e-2, atol=1e-2)
    negotiated.close()
    strict = RemoteWalkFfn(shard, wire=F32, hidden_size=H)
    with pytest.raises(BackendUnavailable, match="does not speak wire f32; it speaks f16, i8"):
        strict.forward(4, x)
    strict.close()
    monkeypatch.setattr(RemoteWalkFfn, "shard_stats", stats_saying(hidden_size=999))
    other = RemoteWalkFfn(shard, hidden_size=H)
    with pytest.raises(BackendFailure, match="serves hidden size 999"):
        other.forward(4, x)
    other.close()


def test_batch_dispatch_asks_every_layer_of_a_step_in_one_request(
    smollm2: Model, shard: str
) -> None:
    """`dispatch=batch`: a step's first layer asks the shard for every layer at once, all of its
    own input (the later layers' answers are the FFN of that input, not of theirs: the
    approximation); one request per step, where streaming makes one per layer."""
    router = build_ffn(smollm2, f"remote-walk:endpoint={shard},dispatch=batch")
    client = router.backends[0]
    assert client is router.backends[29] and client.layers == list(range(30))
    dense = DenseFfn(smollm2)
    draw = torch.Generator().manual_seed(4)
    first, other = torch.randn(2, H, generator=draw), torch.randn(2, H, generator=draw)
    assert torch.equal(router.forward(0, first), dense.forward(0, first))
    requests = client.stats.requests
    assert torch.equal(router.forward(1, other), dense.forward(1, first))  # not of `other`
    assert torch.equal(router.forward(29, other), dense.forward(29, first))
    assert client.stats.requests == requests  # answered by the first layer's request
    ids = smollm2.tokenizer.encode(PROMPT)
    before = client.stats.requests
    tokens = generate(
        parse_engine("standard").build(smollm2), smollm2, router, ids, 4, stop_ids=frozenset()
    ).tokens
    assert len(tokens) == 4 and client.stats.requests - before == 4  # prefill + 3 steps
    router.close()


def test_ffn_dispatch_on_the_command_line(shard: str) -> None:
    from typer.testing import CliRunner

    from larql.cli.app import app

    ran = CliRunner().invoke(
        app, ["run", PROMPT, "-n", "2", "--ffn", shard, "--ffn-dispatch", "batch"]
    )
    assert ran.exit_code == 0, ran.output
    misplaced = CliRunner().invoke(app, ["run", PROMPT, "--ffn-dispatch", "batch"])
    assert misplaced.exit_code == 2 and "applies to --ffn URL" in misplaced.stderr
    unknown = CliRunner().invoke(app, ["run", PROMPT, "--ffn", shard, "--ffn-dispatch", "bulk"])
    assert unknown.exit_code == 2 and "accepted: streaming, batch" in unknown.stderr
