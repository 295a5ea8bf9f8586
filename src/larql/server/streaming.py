"""A session's events → an HTTP answer: server-sent events (`data: {...}` chunks, then
`data: [DONE]`) or one JSON body. Either way, a client that goes away cancels its session."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from larql.server.errors import ApiError, error_body
from larql.server.scheduler import DoneEvent, ErrorEvent, Scheduler, Session, TokenEvent
from larql.server.schemas import ResponseShape, usage

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming request checks for its client


def larql_extra(session: Session, done: DoneEvent) -> dict[str, Any]:
    """What a client can see of its engine: the spec it got, its state's bytes (`memory` splits
    them by tier and adds the growth reserve), the token ids."""
    return {
        "engine": session.request.engine_spec,
        "memory_bytes": done.memory.state,
        "memory": done.memory.as_json(),
        "token_ids": list(done.token_ids),
    }


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


async def stream_events(
    scheduler: Scheduler, session: Session, shape: ResponseShape, include_usage: bool
) -> AsyncIterator[str]:
    """The SSE body. Starlette cancels this generator when the client disconnects; the
    `finally` then cancels the session, which frees its engine."""
    try:
        if shape.chat:
            yield sse(shape.chunk("", role=True))
        while True:
            event = await session.events.get()
            if isinstance(event, TokenEvent):
                yield sse(shape.chunk(event.text))
            elif isinstance(event, DoneEvent):
                final = shape.chunk(None, event.finish_reason)
                final["larql"] = larql_extra(session, event)
                yield sse(final)
                if include_usage:
                    yield sse(shape.usage_chunk(usage(event.prompt_tokens, len(event.token_ids))))
                yield sse("[DONE]")
                return
            else:
                yield sse(error_body(event.message, event.type, None, event.code))
                yield sse("[DONE]")
                return
    finally:
        scheduler.cancel(session)


async def collect(
    request: Request, scheduler: Scheduler, session: Session, shape: ResponseShape
) -> dict[str, Any]:
    """Wait for the whole generation; a client that disconnects meanwhile cancels it."""
    pieces: list[str] = []
    clock = asyncio.get_running_loop().time
    next_check = clock() + DISCONNECT_POLL_S
    try:
        while True:
            try:
                event = await asyncio.wait_for(session.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                event = None
            if clock() >= next_check:  # checked on a clock: tokens may never stop arriving
                next_check = clock() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise ApiError(499, "client closed the request")
            if event is None:
                continue
            if isinstance(event, TokenEvent):
                pieces.append(event.text)
            elif isinstance(event, DoneEvent):
                counts = usage(event.prompt_tokens, len(event.token_ids))
                extra = larql_extra(session, event)
                return shape.whole("".join(pieces), event.finish_reason, counts, extra)
            elif isinstance(event, ErrorEvent):
                raise ApiError(event.status, event.message, event.type, None, event.code)
    finally:
        scheduler.cancel(session)
