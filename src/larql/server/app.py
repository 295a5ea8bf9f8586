"""The FastAPI app: OpenAI routes, the engine catalog, health and Prometheus metrics, over one
model and one scheduler."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from larql.inference.engine import Engine
from larql.inference.ffn import DenseFfn
from larql.inference.prefix_cache import PrefixCache, default_size
from larql.kv.catalog import catalog_rows
from larql.models.model import Model
from larql.server.access_log import ENGINE_KEY, SESSIONS_KEY, AccessLog
from larql.server.errors import ApiError, bad_request, error_body, install_error_handlers
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
from larql.server.steps import Steps
from larql.server.streaming import collect, larql_extra, stream_events
from larql.server.tokenize import TOKENIZER_ENDPOINTS, add_tokenizer_routes

ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/engines",
    "/health",
    "/metrics",
    *TOKENIZER_ENDPOINTS,
)


def create_app(
    model: Model, settings: ServerSettings | None = None, steps: Steps | None = None
) -> FastAPI:
    """The app over `model`; `steps` runs the scheduler's model work (default: here; a
    tensor-parallel rank 0: `larql.server.tensor_parallel.MirroredSteps`)."""
    settings = settings or ServerSettings()
    metrics = ServerMetrics()
    cache_bytes = settings.prefix_cache_bytes
    cache = PrefixCache(default_size(model) if cache_bytes is None else cache_bytes)
    limits = settings.scheduler_limits()
    scheduler = Scheduler(model, DenseFfn(model), limits, metrics, prefix_cache=cache, steps=steps)
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
    app.add_middleware(CountRequests, metrics=metrics)
    if settings.access_log:  # the outermost: its time is the whole answer's
        app.add_middleware(AccessLog, verbose=settings.verbose)

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

    def submit(prepared: list[Prepared]) -> list[Session]:
        """Every prompt's session, or none of them (the scheduler is full or closing)."""
        sessions: list[Session] = []
        try:
            for session_request, engine in prepared:
                loop = asyncio.get_running_loop()
                sessions.append(scheduler.submit(session_request, engine, loop))
        except QueueFull as e:
            for stream in sessions:
                scheduler.cancel(stream)
            raise ApiError(
                429,
                f"the server is at capacity ({settings.max_sessions} sessions decoding, "
                f"{settings.max_queue} queued); retry after {e.retry_after_s} s",
                "rate_limit_error",
                code="server_busy",
                headers={"Retry-After": str(e.retry_after_s)},
            ) from None
        except SchedulerClosed:
            for stream in sessions:
                scheduler.cancel(stream)
            raise ApiError(503, "the server is shutting down", "server_error") from None
        return sessions

    async def answer(
        request: Request,
        body: GenerationFields,
        prepared: list[Prepared],
        chat: bool,
    ) -> Response:
        sessions = submit(prepared)
        setattr(request.state, ENGINE_KEY, prepared[0][0].engine_spec)
        setattr(request.state, SESSIONS_KEY, sessions)
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
            for stream in sessions:
                scheduler.cancel(stream)
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

    # Parsing, validating and tokenizing a request run on a worker thread: a prompt of
    # megabytes takes seconds to tokenize, and on the event loop every stream and /health
    # would wait for it. A text longer than any prompt that fits is refused untokenized.
    most_chars = TextBound(model, settings)

    def read_completion(raw: bytes) -> tuple[CompletionRequest, list[Prepared]]:
        body = parse_body(CompletionRequest, raw)
        for prompt in body.prompts():
            if isinstance(prompt, str):
                most_chars.check(len(prompt), "prompt")
        return body, prepare_completion(body, model, settings)

    def read_chat(raw: bytes) -> tuple[ChatCompletionRequest, list[Prepared]]:
        body = parse_body(ChatCompletionRequest, raw)
        most_chars.check(sum(len(m.text()) for m in body.messages), "messages")
        return body, [prepare_chat(body, model, settings)]

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body, prepared = await asyncio.to_thread(read_completion, await request.body())
        return await answer(request, body, prepared, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body, prepared = await asyncio.to_thread(read_chat, await request.body())
        return await answer(request, body, prepared, True)

    # text to tokenize may be longer than a prompt this server takes (a client counting it
    # learns that), but no longer than the model's context could hold
    most_tokenized = TextBound(model, dataclasses.replace(settings, max_prompt_tokens=None))
    add_tokenizer_routes(app, model, settings, most_tokenized.check, parse_body)
    return app


Prepared = tuple[SessionRequest, Engine]


class TextBound:
    """The most characters of text a prompt this server accepts can hold: its longest prompt
    (`--max-prompt-tokens`, else the context) times the characters of the model's longest
    token (a token's string is never shorter than the text it stands for). Longer text cannot
    fit, so it is refused before the tokenizer spends seconds on it, holding the interpreter
    lock the scheduler needs too."""

    def __init__(self, model: Model, settings: ServerSettings) -> None:
        vocab = model.tokenizer.tokenizer.get_vocab(with_added_tokens=True)
        self.token_chars = max(map(len, vocab), default=1)
        self.tokens = settings.max_prompt_tokens or model.config.max_positions
        self.most = self.tokens * self.token_chars

    def check(self, chars: int, field: str) -> None:
        if chars > self.most:
            raise bad_request(
                f"the {field} text is {chars} characters; this server tokenizes at most "
                f"{self.most} ({self.tokens} tokens of at most {self.token_chars} characters)",
                field,
                "context_length_exceeded",
            )


Body = TypeVar("Body", bound=BaseModel)


def parse_body(schema: type[Body], raw: bytes) -> Body:
    """A generation request's body as JSON whatever its Content-Type says, as the
    OpenAI-compatible servers people use read it (`curl -d '{…}'` sends a form type), checked
    against `schema`; its problems are the validation errors FastAPI raises for a declared
    body (a 400 naming the field)."""
    missing = RequestValidationError([{"type": "missing", "loc": ("body",), "input": None}])
    if not raw:
        raise missing
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        detail = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        error = {"type": "json_invalid", "loc": ("body",), "ctx": {"error": detail}}
        raise RequestValidationError([error]) from None
    if data is None:
        raise missing
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in e.errors()]
        raise RequestValidationError(errors) from None


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


# a refused body's connection closes after the answer: the server reads none of what is left
CLOSE = {"Connection": "close"}


class BodyTooLarge(HTTPException):
    def __init__(self, size: str, max_bytes: int) -> None:
        super().__init__(413, f"the body is {size}; the limit is {max_bytes}", CLOSE)


class LimitBody:
    """Refuses a body over `max_bytes` (413): a declared Content-Length before anything reads
    it; any other body (chunked) as soon as the bytes read pass the limit, so nothing reads
    much past it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            message = f"the body is {int(declared)} bytes; the limit is {self.max_bytes}"
            response = JSONResponse(error_body(message), status_code=413, headers=CLOSE)
            await response(scope, receive, send)
            return
        read = 0

        async def counted() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_bytes:
                    raise BodyTooLarge(f"over {self.max_bytes} bytes", self.max_bytes)
            return message

        await self.app(scope, counted, send)
