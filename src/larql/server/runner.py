"""Running the app with uvicorn on a socket we bind ourselves, so `--port 0` works and the
actual address is known (and printed) before the first request."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from larql.errors import LarqlError

# uvicorn waits this long past the sessions' own shutdown timeout for their streams to send
# their last event, before it cuts the connections still open
CLOSE_MARGIN_S = 5.0
KEEP_ALIVE_S = 30  # FFN-shard clients hold one connection across a whole generation
_EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class ServerStartError(LarqlError):
    """The address cannot be bound (in use, not local, no permission)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0 = an ephemeral port).

    Created with proto=IPPROTO_TCP on purpose: asyncio only sets TCP_NODELAY on accepted
    sockets whose proto says TCP, and without it every small response waits out the client's
    delayed ACK (~40 ms per request)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )[0]
    except (OSError, OverflowError, UnicodeError) as e:
        raise ServerStartError(f"cannot listen on {host}:{port}: {e}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except (OSError, OverflowError) as e:
        sock.close()
        reason = getattr(e, "strerror", None) or str(e)
        raise ServerStartError(f"cannot listen on {host}:{port}: {reason}") from None
    sock.listen(2048)  # connections queue from now on, even before uvicorn starts serving
    return sock


def url_of(sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


class _Server(uvicorn.Server):
    """On a signal, uvicorn stops accepting connections and waits for the open ones; the
    scheduler meanwhile lets running sessions finish until its shutdown timeout, then ends
    the rest with an error event, so open streams end cleanly instead of being cut off. A
    second signal ends them at once."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: object) -> None:
        self.end_sessions(at_once=self.should_exit)
        super().handle_exit(sig, frame)  # type: ignore[arg-type]

    def end_sessions(self, at_once: bool = False) -> None:
        scheduler = getattr(self._app.state, "scheduler", None)
        if scheduler is not None:
            scheduler.begin_shutdown(0.0 if at_once else None)


def _server(app: FastAPI) -> _Server:
    settings = getattr(app.state, "settings", None)
    sessions_s = getattr(settings, "shutdown_timeout_s", 0.0)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=sessions_s + CLOSE_MARGIN_S,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    return _Server(config, app)


def _serve_then_stop(server: _Server, sock: socket.socket) -> None:
    """uvicorn on this thread; when it stops, for whatever reason, so does the scheduler."""
    try:
        server.run(sockets=[sock])
    finally:
        server.end_sessions(at_once=True)


def serve_forever(
    app: FastAPI, host: str, port: int, on_listening: Callable[[str], None] | None = None
) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM). An app with a scheduler runs its loop on
    this (the main) thread and HTTP on another (the scheduler's module says why)."""
    sock = bind(host, port)
    if on_listening is not None:
        on_listening(url_of(sock, host))
    server = _server(app)
    scheduler = getattr(app.state, "scheduler", None)
    if scheduler is None:
        server.run(sockets=[sock])
        return
    scheduler.claim_this_thread()
    http = threading.Thread(target=_serve_then_stop, args=(server, sock), name="larql-http")
    http.start()
    # uvicorn installs no signal handlers off the main thread: these do what its own would
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in _EXIT_SIGNALS}
    try:
        scheduler.run()  # until shutdown has ended every session
    finally:
        server.end_sessions(at_once=True)
        server.should_exit = True
        http.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass
class BackgroundServer:
    """A server on a thread of this process (tests, benchmarks, embedding)."""

    url: str
    _server: _Server
    _thread: threading.Thread

    def stop(self, timeout_s: float = 30.0) -> None:
        self._server.end_sessions(at_once=True)
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> BackgroundServer:
        return self

    def wait_started(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ServerStartError("the server did not start")
            time.sleep(0.01)

    def __exit__(self, *_: object) -> None:
        self.stop()


def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> BackgroundServer:
    sock = bind(host, port)
    server = _server(app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    return BackgroundServer(url_of(sock, host), server, thread)
