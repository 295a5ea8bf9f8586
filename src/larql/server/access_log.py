"""The access log of `larql serve`: one line on stderr per answered request, when it has been
answered in full (a stream at its last event): `POST /v1/completions 200 412.3 ms
engine=markov-rs:window=64`, the engine being the spec the request decoded with (`-` for a
request that decoded nothing). The client's address and the query string are left out: the
log names what was served, not who asked. Verbose (`larql serve -v`), a request that decoded
adds what ran: `prompt=… cached=… new=… path=…` — prompt tokens (those taken from the prefix
cache), tokens generated, and the decode path of its steps (device · dtype · weights · kernels)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ENGINE_KEY = "larql_engine"  # the request state's key the routes set to the spec they ran
SESSIONS_KEY = "larql_sessions"  # … and to the sessions that decoded it


class Ran(Protocol):
    """What a session noted as it ended (`scheduler.Session`)."""

    @property
    def prompt_tokens(self) -> int: ...

    cached_tokens: int
    generated: int
    decode_path: str | None


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def access_line(method: str, path: str, status: int, ms: float, engine: str | None) -> str:
    return f"{method} {path} {status} {ms:.1f} ms engine={engine or '-'}"


def what_ran(sessions: Sequence[Ran]) -> str:
    """`-v`'s addition: one request's sessions (a prompt list has several) summed, and their
    decode paths (one, unless they differ)."""
    paths = sorted({s.decode_path for s in sessions if s.decode_path})
    counts = [
        *([f"choices={len(sessions)}"] if len(sessions) > 1 else []),
        f"prompt={sum(s.prompt_tokens for s in sessions)}",
        f"cached={sum(s.cached_tokens for s in sessions)}",
        f"new={sum(s.generated for s in sessions)}",
    ]
    return " ".join(counts) + f" path={' | '.join(paths) or '-'}"


class AccessLog:
    """Plain ASGI (a stream is timed to its end, its chunks untouched)."""

    def __init__(
        self, app: ASGIApp, write: Callable[[str], None] = to_stderr, verbose: bool = False
    ) -> None:
        self.app = app
        self.write = write
        self.verbose = verbose

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
            state = scope.get("state", {})
            engine = state.get(ENGINE_KEY)
            line = access_line(scope["method"], scope["path"], status, ms, engine)
            sessions = state.get(SESSIONS_KEY)
            if self.verbose and sessions:
                line += " " + what_ran(sessions)
            self.write(line)
