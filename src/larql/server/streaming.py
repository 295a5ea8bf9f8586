"""A session's events → an HTTP answer: server-sent events (`data: {...}` chunks, then
`data: [DONE]`) or one JSON body. Either way, a client that goes away cancels its session."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from larql.server.errors import ApiError, error_body
from larql.server.logprobs import Entry, LogprobFormat, prompt_entries
from larql.server.scheduler import (
    DoneEvent,
    ErrorEvent,
    PromptEvent,
    Scheduler,
    Session,
    TokenEvent,
)
from larql.server.schemas import ResponseShape, usage

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming request checks for its client


def larql_extra(stream: Session, done: DoneEvent) -> dict[str, Any]:
    """What a client can see of its engine: the spec it got, its state's bytes (`memory` splits
    them by tier and adds the growth reserve), the token ids."""
    return {
        "engine": stream.request.engine_spec,
        "memory_bytes": done.memory.state,
        "memory": done.memory.as_json(),
        "token_ids": list(done.token_ids),
    }


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


class Logprobs:
    """One response's log-probabilities as they arrive: the echoed prompt (its text is the base
    of every generated token's offset), then the generated tokens."""

    def __init__(self, stream: Session, format: LogprobFormat) -> None:
        self.wanted = stream.request.logprobs is not None
        self.prompt_ids = stream.request.prompt_ids
        self.format = format
        self.echo_text = ""

    def prompt(self, event: PromptEvent) -> tuple[str, list[Entry]]:
        self.echo_text, entries = prompt_entries(
            self.format.tokenizer, self.prompt_ids, event.logprobs
        )
        return self.echo_text, entries if self.wanted else []

    def generated(self, entries: tuple[Entry, ...]) -> list[Entry]:
        return [e.shifted(len(self.echo_text)) for e in entries] if self.wanted else []

    def render(self, entries: list[Entry]) -> dict[str, Any] | None:
        return self.format.render(entries) if self.wanted else None


async def stream_events(
    scheduler: Scheduler,
    stream: Session,
    shape: ResponseShape,
    include_usage: bool,
    format: LogprobFormat,
) -> AsyncIterator[str]:
    """The SSE body. Starlette cancels this generator when the client disconnects; the
    `finally` then cancels the session, which frees its engine. An echoed prompt is the first
    chunk; each chunk carries the log-probabilities of the tokens whose text it carries."""
    logprobs = Logprobs(stream, format)
    try:
        if shape.chat:
            yield sse(shape.chunk("", role=True))
        while True:
            event = await stream.events.get()
            if isinstance(event, PromptEvent):
                text, entries = logprobs.prompt(event)
                yield sse(shape.chunk(text, logprobs=logprobs.render(entries)))
            elif isinstance(event, TokenEvent):
                entries = logprobs.generated(event.logprobs)
                yield sse(shape.chunk(event.text, logprobs=logprobs.render(entries)))
            elif isinstance(event, DoneEvent):
                rest = logprobs.generated(event.logprobs)
                final = shape.chunk(
                    None, event.finish_reason, logprobs=logprobs.render(rest) if rest else None
                )
                final["larql"] = larql_extra(stream, event)
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
        scheduler.cancel(stream)


@dataclass(frozen=True)
class Outcome:
    """One session's whole answer: a choice's text and log-probabilities, and how it ended."""

    text: str
    logprobs: dict[str, Any] | None
    done: DoneEvent


async def collect(
    request: Request, scheduler: Scheduler, stream: Session, format: LogprobFormat
) -> Outcome:
    """Wait for the whole generation; a client that disconnects meanwhile cancels it."""
    logprobs = Logprobs(stream, format)
    pieces: list[str] = []
    entries: list[Entry] = []
    clock = asyncio.get_running_loop().time
    next_check = clock() + DISCONNECT_POLL_S
    try:
        while True:
            try:  # (a timeout scope, not `wait_for`: that starts a task per token)
                async with asyncio.timeout(DISCONNECT_POLL_S):
                    event = await stream.events.get()
            except TimeoutError:
                event = None
            if clock() >= next_check:  # checked on a clock: tokens may never stop arriving
                next_check = clock() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise ApiError(499, "client closed the request")
            if event is None:
                continue
            if isinstance(event, PromptEvent):
                text, prompt = logprobs.prompt(event)
                pieces.insert(0, text)
                entries[:0] = prompt
            elif isinstance(event, TokenEvent):
                pieces.append(event.text)
                entries += logprobs.generated(event.logprobs)
            elif isinstance(event, DoneEvent):
                entries += logprobs.generated(event.logprobs)
                return Outcome("".join(pieces), logprobs.render(entries), event)
            elif isinstance(event, ErrorEvent):
                raise ApiError(event.status, event.message, event.type, None, event.code)
    finally:
        scheduler.cancel(stream)
