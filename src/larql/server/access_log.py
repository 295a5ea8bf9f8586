"""The access log of `larql serve`: one line on stderr per answered request, when it has been
answered in full (a stream at its last event): `POST /v1/completions 200 412.3 ms
engine=markov-rs:window=64`, the engine being the spec the request decoded with (`-` for a
request that decoded nothing). The client's address and the query string are left out: the
log names what was served, not who asked."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ENGINE_KEY = "larql_engine"  # the request state's key the routes set to the spec they ran


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def access_line(method: str, path: str, status: int, ms: float, engine: str | None) -> str:
    return f"{method} {path} {status} {ms:.1f} ms engine={engine or '-'}"


class AccessLog:
    """Plain ASGI (a stream is timed to its end, its chunks untouched)."""

    def __init__(self, app: ASGIApp, write: Callable[[str], None] = to_stderr) -> None:
        self.app = app
        self.write = write

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            ms = 1000 * (time.perf_counter() - start)
            engine = scope.get("state", {}).get(ENGINE_KEY)
            self.write(access_line(scope["method"], scope["path"], status, ms, engine))
