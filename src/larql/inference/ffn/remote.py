"""`remote-walk`: each layer's FFN computed by an FFN shard over HTTP.

One keep-alive `httpx.Client` per backend; the normed residual goes out as f32 and the output
comes back in the wire encoding negotiated by `Accept` (f32 is lossless, f16 and i8 trade
precision for bytes). A connection the shard reset (it restarted, or closed an idle keep-alive)
is retried once on a fresh connection; after that — or on a timeout, which is never retried —
the call fails with `BackendUnavailable`, so a dead shard ends generation with a clear error
within connect + read timeout instead of hanging. A shard that answers but not with a valid
response (an HTTP error, the wrong framing, the wrong layer or shape) is `BackendFailure`.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import torch

from larql.inference.errors import BackendFailure, BackendUnavailable
from larql.inference.ffn.backend import FfnBackend
from larql.inference.ffn.wire import (
    F16,
    F32,
    I8,
    MEDIA_TYPES,
    WireFormatError,
    decode_response,
    encode_request,
    wire_for_media_type,
)

WALK_PATH = "/v1/walk-ffn"
EXPERTS_PATH = "/v1/experts-ffn"


@dataclass
class RemoteStats:
    requests: int = 0
    retries: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    server_ms: float = 0.0  # the shard's own compute time, as it reports it


WIRE_PREFERENCE = (F32, F16, I8)  # lossless first


class RemoteWalkFfn(FfnBackend):
    """An `FfnBackend` whose every layer is a round trip to one FFN shard.

    Before its first request it reads the shard's `/v1/stats` once: a shard of another hidden
    size is refused, and the wire is one the shard speaks — the one asked for (refused if the
    shard does not speak it), or without `wire` the best both speak (f32, lossless, before f16
    and i8). A shard without the endpoint is taken as it is, over f32."""

    kind = "remote walk"

    def __init__(
        self,
        endpoint: str,
        wire: str | None = None,
        hidden_size: int | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        top_k: int = 0,
        dispatch: str = "streaming",
    ) -> None:
        if dispatch not in ("streaming", "batch"):
            raise ValueError(f"unknown dispatch {dispatch!r}; accepted: streaming, batch")
        self.dispatch = dispatch
        self.layers: list[int] | None = None  # the layers it serves (batch dispatch asks all)
        self._predispatched: dict[int, torch.Tensor] = {}
        self._wire_given = wire is not None
        wire = F32 if wire is None else wire
        self._probed = False
        if wire not in MEDIA_TYPES:
            raise ValueError(f"unknown wire {wire!r}; accepted: {', '.join(MEDIA_TYPES)}")
        self.endpoint = endpoint.rstrip("/")
        self.wire = wire
        self.hidden_size = hidden_size
        self.top_k = top_k
        shown_wire = "" if wire == F32 else f",wire={wire}"
        shown_dispatch = ",dispatch=batch" if dispatch == "batch" else ""
        self.name = f"remote-walk:endpoint={self.endpoint}{shown_wire}{shown_dispatch}"
        self.stats = RemoteStats()
        self._timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        # Without TCP_NODELAY a small request waits out the peer's delayed ACK (~40 ms).
        transport = httpx.HTTPTransport(
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
        )
        self._client = httpx.Client(timeout=self._timeout, transport=transport)

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x: [S, H] → the shard's FFN output for `layer`, [S, H] in x's dtype.

        With batch dispatch, the first of a step's layers asks for this one and every later
        layer it serves in one request, all of the same x (one residual on the wire for all
        of them: the FFN of the layers after it sees this layer's input, not its own — an
        approximation, one round trip per step instead of one per layer); the later layers
        take their answers from that request."""
        if self.dispatch == "batch":
            if layer not in self._predispatched:
                later = [lr for lr in (self.layers or [layer]) if lr >= layer] or [layer]
                self._predispatched = self._walk(later, x)
            return self._predispatched.pop(layer)
        (out,) = self._walk(layer, x).values()
        return out

    def forward_layers(self, layers: Sequence[int], x: torch.Tensor) -> dict[int, torch.Tensor]:
        """One batched request: every listed layer's FFN of the same input x: [S, H] (a layer
        listed twice is asked once: a shard refuses repeats)."""
        return self._walk(list(dict.fromkeys(layers)), x)

    def forward_experts(self, units: Sequence[int], x: torch.Tensor) -> dict[int, torch.Tensor]:
        """One batched request to an experts shard: each unit `layer · num_experts + expert`
        → that expert's MLP output of x: [S, H] (not weighted); each unit asked once."""
        return self._walk(list(dict.fromkeys(units)), x, EXPERTS_PATH)

    def wire_bytes(self) -> int:
        return self.stats.bytes_sent + self.stats.bytes_received

    def shard_stats(self) -> dict[str, Any]:
        """The shard's `GET /v1/stats`."""
        return self._request("GET", "/v1/stats").json()

    def close(self) -> None:
        self._client.close()

    # ------------------------------------------------------------------------ internals

    def _probe(self) -> None:
        """The shard's `/v1/stats`, once: check its hidden size, settle the wire."""
        self._probed = True
        try:
            info = self.shard_stats()
        except BackendFailure:  # a shard without /v1/stats: as it is
            return
        spoken = [w for w in WIRE_PREFERENCE if w in info.get("wire", [])]
        if spoken and self.wire not in spoken:
            if self._wire_given:
                raise BackendUnavailable(
                    f"FFN shard {self.endpoint} does not speak wire {self.wire}; it speaks "
                    f"{', '.join(spoken)}"
                )
            self.wire = spoken[0]
        served = info.get("hidden_size")
        if self.hidden_size is not None and served is not None and served != self.hidden_size:
            raise BackendFailure(
                f"FFN shard {self.endpoint} serves hidden size {served}; this model's is "
                f"{self.hidden_size} (a shard of another model?)"
            )

    def _walk(
        self, layers: int | list[int], x: torch.Tensor, path: str = WALK_PATH
    ) -> dict[int, torch.Tensor]:
        if not self._probed:
            self._probe()
        hidden = self.hidden_size or x.shape[-1]
        body = encode_request(layers, x, self.top_k)
        response = self._request(
            "POST",
            path,
            content=body,
            headers={"Content-Type": MEDIA_TYPES[F32], "Accept": MEDIA_TYPES[self.wire]},
        )
        got = wire_for_media_type(response.headers.get("content-type", ""))
        if got != self.wire:
            raise BackendFailure(
                f"FFN shard {self.endpoint} answered {response.headers.get('content-type')!r}; "
                f"asked for {MEDIA_TYPES[self.wire]}"
            )
        batched = not isinstance(layers, int)
        try:
            results, server_ms = decode_response(response.content, self.wire, hidden, batched)
        except WireFormatError as e:
            raise BackendFailure(f"FFN shard {self.endpoint}: malformed response: {e}") from None
        wanted = [layers] if isinstance(layers, int) else layers
        if [layer for layer, _ in results] != wanted or any(
            out.shape[0] != x.shape[0] for _, out in results
        ):
            raise BackendFailure(
                f"FFN shard {self.endpoint} answered layers {[r[0] for r in results]} with "
                f"{[r[1].shape[0] for r in results]} rows; asked for layers {wanted} with "
                f"{x.shape[0]} rows"
            )
        self.stats.server_ms += server_ms
        return {layer: _tensor(out, x) for layer, out in results}

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        url = self.endpoint + path
        for attempt in (1, 2):
            try:
                response = self._client.request(method, url, **kwargs)
                break
            except httpx.TimeoutException as e:
                raise BackendUnavailable(
                    f"FFN shard {self.endpoint} did not answer in time ({type(e).__name__}; "
                    f"connect {self._timeout.connect}s, read {self._timeout.read}s)"
                ) from None
            except httpx.TransportError as e:
                if attempt == 1:  # a reset keep-alive connection: once more on a fresh one
                    self.stats.retries += 1
                    continue
                raise BackendUnavailable(
                    f"FFN shard {self.endpoint} cannot be reached ({type(e).__name__}: {e})"
                ) from None
        self.stats.requests += 1
        self.stats.bytes_sent += len(kwargs.get("content") or b"")
        self.stats.bytes_received += len(response.content)
        if response.status_code != 200:
            raise BackendFailure(
                f"FFN shard {self.endpoint} answered HTTP {response.status_code}: "
                f"{_error_message(response)}"
            )
        return response


def _tensor(out: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.array(out, dtype=np.float32)).to(like.device, like.dtype)


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error", {})
        return str(error.get("message", error)) if isinstance(error, dict) else str(error)
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        return response.text[:200] or "(empty body)"
