"""The FastAPI app: OpenAI routes, the engine catalog, health and Prometheus metrics, over one
model and one scheduler."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from larql.inference.engine import Engine
from larql.inference.ffn import DenseFfn
from larql.kv.catalog import catalog_rows
from larql.models.model import Model
from larql.server.errors import ApiError, error_body, install_error_handlers
from larql.server.logprobs import LogprobFormat
from larql.server.metrics import PROMETHEUS_CONTENT_TYPE, ServerMetrics
from larql.server.prepare import check_model_name, prepare_chat, prepare_completion
from larql.server.scheduler import (
    QueueFull,
    Scheduler,
    SchedulerClosed,
    Session,
    SessionRequest,
)
from larql.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationFields,
    ResponseShape,
    usage,
)
from larql.server.settings import ServerSettings
from larql.server.streaming import collect, larql_extra, stream_events

GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/engines",
    "/health",
    "/metrics",
)


def create_app(model: Model, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    metrics = ServerMetrics()
    scheduler = Scheduler(model, DenseFfn(model), settings.scheduler_limits(), metrics)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.close)

    app = FastAPI(
        title="larql",
        description="OpenAI-compatible decode through larql's KV engines",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.model = model
    app.state.settings = settings
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(LimitBody, max_bytes=settings.max_body_bytes)
    app.add_middleware(BodyIsJson, paths=GENERATION_ENDPOINTS)
    app.add_middleware(CountRequests, metrics=metrics)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        active, queued = scheduler.counts()
        return {
            "status": "ok",
            "model": model.name,
            "active_sessions": active,
            "queued_sessions": queued,
        }

    card = {
        "id": model.name,
        "object": "model",
        "created": started,
        "owned_by": "larql",
        "max_model_len": model.config.max_positions,
        "default_engine": settings.default_engine.spec(),
    }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str) -> dict[str, Any]:
        check_model_name(name, model, settings)
        return card

    @app.get("/v1/engines")
    async def engines() -> dict[str, Any]:
        return {
            "object": "list",
            "default": settings.default_engine.spec(),
            "data": catalog_rows(),
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    def submit(prepared: list[tuple[SessionRequest, Engine]]) -> list[Session]:
        """Every prompt's session, or none of them (the scheduler is full or closing)."""
        sessions: list[Session] = []
        try:
            for session_request, engine in prepared:
                loop = asyncio.get_running_loop()
                sessions.append(scheduler.submit(session_request, engine, loop))
        except QueueFull as e:
            for session in sessions:
                scheduler.cancel(session)
            raise ApiError(
                429,
                f"the server is at capacity ({settings.max_sessions} sessions decoding, "
                f"{settings.max_queue} queued); retry after {e.retry_after_s} s",
                "rate_limit_error",
                code="server_busy",
                headers={"Retry-After": str(e.retry_after_s)},
            ) from None
        except SchedulerClosed:
            for session in sessions:
                scheduler.cancel(session)
            raise ApiError(503, "the server is shutting down", "server_error") from None
        return sessions

    async def answer(
        request: Request,
        body: GenerationFields,
        prepared: list[tuple[SessionRequest, Engine]],
        chat: bool,
    ) -> Response:
        sessions = submit(prepared)
        shape = ResponseShape(chat, model.name)
        format = LogprobFormat(model.tokenizer, chat)
        if body.stream:
            return StreamingResponse(
                stream_events(scheduler, sessions[0], shape, body.include_usage, format),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        tasks = [asyncio.ensure_future(collect(request, scheduler, s, format)) for s in sessions]
        try:
            outcomes = await asyncio.gather(*tasks)
        finally:  # one failed: the others end too
            for task in tasks:
                task.cancel()
            for session in sessions:
                scheduler.cancel(session)
        choices = [
            shape.choice(i, o.text, o.done.finish_reason, o.logprobs)
            for i, o in enumerate(outcomes)
        ]
        prompt_tokens = sum(o.done.prompt_tokens for o in outcomes)
        generated = sum(len(o.done.token_ids) for o in outcomes)
        extras = [larql_extra(s, o.done) for s, o in zip(sessions, outcomes, strict=True)]
        if len(extras) == 1:
            extra = extras[0]
        else:  # one engine spec for all; the rest by choice
            extra = {
                "engine": extras[0]["engine"],
                "choices": [{k: v for k, v in x.items() if k != "engine"} for x in extras],
            }
        return JSONResponse(shape.whole(choices, usage(prompt_tokens, generated), extra))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await answer(request, body, prepare_completion(body, model, settings), False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await answer(request, body, [prepare_chat(body, model, settings)], True)

    return app


class CountRequests:
    """Counts every HTTP answer by endpoint and status (plain ASGI, so streams are untouched)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        if path.startswith("/v1/models/"):
            endpoint = "/v1/models/{model}"
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()


class LimitBody:
    """Refuses a declared body over `max_bytes` (413) before anything reads it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            declared = dict(scope.get("headers", ())).get(b"content-length", b"")
            if declared.isdigit() and int(declared) > self.max_bytes:
                message = f"the body is {int(declared)} bytes; the limit is {self.max_bytes}"
                await JSONResponse(error_body(message), status_code=413)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyIsJson:
    """Reads the body of a generation request as JSON whatever its Content-Type says, as the
    OpenAI-compatible servers people use do: `curl -d '{…}'` sends a form type. A body that
    is not JSON is still answered 400."""

    def __init__(self, app: ASGIApp, paths: tuple[str, ...]) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") in self.paths:
            headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)
