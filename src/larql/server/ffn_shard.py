"""An FFN shard: serves the FFN of a range of layers over HTTP , so a client's
`remote-walk` backend can run its layers elsewhere; or, for a mixture-of-experts model, a range
of experts of every MoE layer, for a client's `remote-experts` backend.

    POST /v1/walk-ffn     one layer or a batch of layers of one residual → FFN output
                          (binary framing of `larql.inference.ffn.wire`, or JSON)
    POST /v1/experts-ffn  the same framing; each unit `layer · num_experts + expert` → that
                          expert's MLP output of the rows (not weighted: the client routes)
    GET  /v1/stats        what the shard serves and what it has done
    GET  /health          liveness

The shard runs the walk FFN (top_k = 0: dense-equivalent) on the normed residual it is sent.
A layer outside the shard's range, a malformed body or a wrong hidden size is a 4xx with a JSON
error. Model compute runs in a worker thread, never on the event loop.

What one request may ask is bounded before anything is computed: its body (read up to the
limit, chunked or not) carries exactly the rows it declares, at most the model's context; a
batch lists each layer (or unit) once, and each must be served here — so an answer is the
declared layers × rows × hidden values, at most the served layers' worth of the request.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from larql.errors import LarqlError
from larql.inference.ffn.experts import expert_glu, expert_output
from larql.inference.ffn.walk import WalkFfn
from larql.inference.ffn.wire import (
    F32,
    JSON_MEDIA_TYPE,
    MEDIA_TYPES,
    WalkRequest,
    WireFormatError,
    decode_json_request,
    decode_request,
    encode_response,
    wire_for_media_type,
)
from larql.models.model import Model
from larql.server.errors import error_body
from larql.server.runner import BackgroundServer, serve_forever, serve_in_thread


class ShardLayersError(LarqlError):
    """A `--layers` or `--experts` range the model does not have."""


class ShardRequestError(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


Layers = range | tuple[int, int] | None  # a range, or inclusive (A, B) as `--layers A-B` says


def shard_layers(model: Model, layers: Layers) -> range:
    n = model.config.num_layers
    if layers is None:
        return range(n)
    if isinstance(layers, tuple):
        layers = range(layers[0], layers[1] + 1)
    if layers.step != 1 or len(layers) == 0 or layers.start < 0 or layers.stop > n:
        shown = f"{layers.start}-{layers.stop - 1}" if len(layers) else "an empty range"
        raise ShardLayersError(f"cannot serve layers {shown}: {model.name} has layers 0-{n - 1}")
    return layers


def shard_experts(model: Model, experts: Layers) -> range | None:
    if experts is None:
        return None
    routing = model.config.experts
    if routing is None:
        raise ShardLayersError(f"--experts needs a mixture-of-experts model; {model.name} has none")
    if isinstance(experts, tuple):
        experts = range(experts[0], experts[1] + 1)
    n = routing.num_experts
    if experts.step != 1 or len(experts) == 0 or experts.start < 0 or experts.stop > n:
        shown = f"{experts.start}-{experts.stop - 1}" if len(experts) else "an empty range"
        raise ShardLayersError(f"cannot serve experts {shown}: {model.name} has experts 0-{n - 1}")
    return experts


class FfnShard:
    """The model side of the shard: checks requests and computes their layers (or experts)."""

    def __init__(self, model: Model, layers: Layers = None, experts: Layers = None) -> None:
        self.model = model
        self.layers = shard_layers(model, layers)
        self.experts = shard_experts(model, experts)
        self.hidden_size = model.config.hidden_size
        # The most rows one request may declare, and a generous bound on one body: every
        # position of the context, f32, plus headers (JSON carries fewer values in it).
        self.max_rows = model.config.max_positions
        self.max_body = self.max_rows * self.hidden_size * 4 + 65_536
        self._walks: dict[int, WalkFfn] = {}
        self._lock = threading.Lock()
        self._started = time.time()
        self.counts: Counter[str] = Counter()
        self.compute_ms = 0.0

    def describe(self) -> dict[str, Any]:
        with self._lock:
            counts, compute_ms = dict(self.counts), self.compute_ms
        return {
            "model": self.model.name,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "hidden_size": self.hidden_size,
            "num_layers": self.model.config.num_layers,
            "layers": [self.layers.start, self.layers.stop - 1],
            "max_rows": self.max_rows,
            "wire": list(MEDIA_TYPES),
            **self._experts_described(),
            "uptime_s": round(time.time() - self._started, 3),
            "compute_ms": round(compute_ms, 3),
            **counts,
        }

    def _experts_described(self) -> dict[str, Any]:
        if self.experts is None or self.model.config.experts is None:
            return {}
        return {
            "experts": [self.experts.start, self.experts.stop - 1],
            "num_experts": self.model.config.experts.num_experts,
        }

    def count(self, **increments: float) -> None:
        with self._lock:
            for key, value in increments.items():
                self.counts[key] += value

    def parse(self, body: bytes, content_type: str) -> tuple[WalkRequest, bool]:
        """→ (request, whether it came as JSON)."""
        base = content_type.split(";", 1)[0].strip().lower()
        try:
            if base == JSON_MEDIA_TYPE:
                try:
                    payload = json.loads(body)
                except (ValueError, RecursionError):
                    raise WireFormatError("the request body is not valid JSON") from None
                return self._rows_checked(decode_json_request(payload, self.hidden_size)), True
            if base in ("", MEDIA_TYPES[F32], "application/octet-stream"):
                return self._rows_checked(decode_request(body, self.hidden_size)), False
        except WireFormatError as e:
            code = "wrong_hidden_size" if e.status == 422 else "malformed_body"
            raise ShardRequestError(e.status, str(e), code) from None
        raise ShardRequestError(
            415,
            f"unsupported Content-Type {content_type!r}; send {MEDIA_TYPES[F32]} or "
            f"{JSON_MEDIA_TYPE}",
            "unsupported_media_type",
        )

    def _rows_checked(self, request: WalkRequest) -> WalkRequest:
        if request.seq_len > self.max_rows:
            raise ShardRequestError(
                413,
                f"the request declares {request.seq_len} rows; this shard takes at most "
                f"{self.max_rows} (the model's context)",
                "too_large",
            )
        return request

    def check_layers(self, request: WalkRequest) -> None:
        for layer in request.layers:
            if layer not in self.layers:
                raise ShardRequestError(
                    422,
                    f"layer {layer} is not served by this shard (layers {self.layers.start}-"
                    f"{self.layers.stop - 1})",
                    "layer_not_served",
                )

    def check_experts(self, request: WalkRequest) -> None:
        """Every unit `layer · num_experts + expert` names a served expert of an MoE layer."""
        routing = self.model.config.experts
        if self.experts is None or routing is None:
            raise ShardRequestError(
                404,
                "this shard serves layers, not experts (larql serve --ffn-only --experts A-B)",
                "experts_not_served",
            )
        for unit in request.layers:
            layer, expert = divmod(unit, routing.num_experts)
            moe = layer in self.layers and self.model.weights.layers[layer].experts is not None
            if not moe or expert not in self.experts:
                raise ShardRequestError(
                    422,
                    f"unit {unit} (layer {layer}, expert {expert}) is not served by this shard "
                    f"(experts {self.experts.start}-{self.experts.stop - 1} of the MoE layers "
                    f"among {self.layers.start}-{self.layers.stop - 1})",
                    "expert_not_served",
                )

    def compute(self, request: WalkRequest) -> tuple[list[tuple[int, np.ndarray]], float]:
        """→ ([(layer, FFN output [S, H] float32)], compute ms). Runs in a worker thread."""
        walk = self._walk(request.top_k)
        return self._timed(request, lambda layer, x: walk.forward(layer, x))

    def compute_experts(self, request: WalkRequest) -> tuple[list[tuple[int, np.ndarray]], float]:
        """→ ([(unit, expert MLP output [S, H] float32)], compute ms). A worker thread."""
        routing = self.model.config.experts
        assert routing is not None
        glu = expert_glu(self.model.config)

        def one(unit: int, x: torch.Tensor) -> torch.Tensor:
            layer, expert = divmod(unit, routing.num_experts)
            experts = self.model.weights.layers[layer].experts
            assert experts is not None
            return expert_output(experts, expert, x, glu)

        return self._timed(request, one)

    def _timed(
        self, request: WalkRequest, unit_output: Callable[[int, torch.Tensor], torch.Tensor]
    ) -> tuple[list[tuple[int, np.ndarray]], float]:
        t0 = time.perf_counter()
        x = torch.from_numpy(np.array(request.residual, dtype=np.float32))
        x = x.to(self.model.device, self.model.dtype)  # [S, H]
        with torch.inference_mode():
            results = [
                (unit, unit_output(unit, x).to("cpu", torch.float32).numpy())
                for unit in request.layers
            ]
        ms = (time.perf_counter() - t0) * 1000
        with self._lock:
            self.compute_ms += ms
            self.counts["layer_calls"] += len(request.layers)
            self.counts["rows"] += request.seq_len * len(request.layers)
        return results, ms

    def _walk(self, top_k: int) -> WalkFfn:
        with self._lock:
            walk = self._walks.get(top_k)
            if walk is None:
                walk = self._walks[top_k] = WalkFfn(self.model, top_k or None)
            return walk


def negotiate(accept: str, json_request: bool) -> str | None:
    """The response encoding: the first supported type `Accept` lists, in its order
    (None = JSON); with no preference, answer in the request's own form."""
    for item in accept.split(","):
        media = item.split(";", 1)[0].strip().lower()
        if media == JSON_MEDIA_TYPE:
            return None
        wire = wire_for_media_type(media)
        if wire is not None:
            return wire
        if media in ("*/*", "application/*"):
            return None if json_request else F32
    if not accept.strip():
        return None if json_request else F32
    raise ShardRequestError(
        406,
        f"cannot answer in {accept!r}; accepted: {', '.join(MEDIA_TYPES.values())}, "
        f"{JSON_MEDIA_TYPE}",
        "not_acceptable",
    )


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(message, code=code), status_code=status)


def create_ffn_app(model: Model, layers: Layers = None, experts: Layers = None) -> FastAPI:
    """The shard's FastAPI app for `layers` of `model` (all layers when None); with `experts`,
    for those experts of its MoE layers too."""
    shard = FfnShard(model, layers, experts)
    app = FastAPI(title="larql FFN shard", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.shard = shard

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        return shard.describe()

    @app.post("/v1/walk-ffn")
    async def walk_ffn(request: Request) -> Response:
        return await _answer(shard, request, shard.check_layers, shard.compute)

    @app.post("/v1/experts-ffn")
    async def experts_ffn(request: Request) -> Response:
        return await _answer(shard, request, shard.check_experts, shard.compute_experts)

    return app


Compute = Callable[[WalkRequest], tuple[list[tuple[int, np.ndarray]], float]]


async def _answer(
    shard: FfnShard, request: Request, check: Callable[[WalkRequest], None], compute: Compute
) -> Response:
    """Read, check, compute (in a worker thread) and encode one request of the shard."""
    try:
        declared = int(request.headers.get("content-length") or 0)
    except ValueError:
        declared = 0
    if declared > shard.max_body:
        shard.count(errors=1)
        return _error(413, f"body of {declared} bytes exceeds {shard.max_body}", "too_large")
    try:
        body = await _read_body(request, shard.max_body)
        walk, json_request = shard.parse(body, request.headers.get("content-type", ""))
        wire = negotiate(request.headers.get("accept", ""), json_request)
        check(walk)
    except ShardRequestError as e:
        shard.count(errors=1)
        return _error(e.status, e.message, e.code)
    results, ms = await run_in_threadpool(compute, walk)
    shard.count(requests=1, bytes_in=len(body), **{f"wire_{wire or 'json'}": 1})
    if wire is None:
        if walk.batched:
            payload: dict[str, Any] = {
                "latency_ms": ms,
                "results": [
                    {"layer": layer, "seq_len": out.shape[0], "output": out.ravel().tolist()}
                    for layer, out in results
                ],
            }
        else:
            layer, out = results[0]
            payload = {
                "layer": layer,
                "seq_len": out.shape[0],
                "latency_ms": ms,
                "output": out.ravel().tolist(),
            }
        return JSONResponse(payload)
    content = encode_response(results, ms, wire, walk.batched)
    shard.count(bytes_out=len(content))
    return Response(content, media_type=MEDIA_TYPES[wire])


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, read no further than `limit` bytes whatever Content-Length said (a chunked
    body declares none)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ShardRequestError(413, f"body exceeds {limit} bytes", "too_large")
        chunks.append(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------------- running it


def run_ffn_shard(
    model: Model,
    layers: Layers = None,
    host: str = "127.0.0.1",
    port: int = 8080,
    experts: Layers = None,
) -> None:
    """Serve `layers` (with `experts`: those experts of them) of `model` until interrupted;
    announces the address on stderr."""
    app = create_ffn_app(model, layers, experts)
    served, routed = app.state.shard.layers, app.state.shard.experts
    what = "" if routed is None else f" experts {routed.start}-{routed.stop - 1} of"

    def announce(url: str) -> None:
        print(
            f"larql FFN shard: {model.name}{what} layers {served.start}-{served.stop - 1} "
            f"listening on {url}",
            file=sys.stderr,
            flush=True,
        )

    serve_forever(app, host, port, on_listening=announce)


def start_shard(app: FastAPI, host: str = "127.0.0.1") -> BackgroundServer:
    """A shard on a thread of this process, on an ephemeral port (tests and benchmarks):
    `with start_shard(create_ffn_app(model)) as shard: … shard.url …`."""
    server = serve_in_thread(app, host, 0)
    server.wait_started()
    return server
