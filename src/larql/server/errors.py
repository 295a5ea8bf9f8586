"""Every error the server answers is OpenAI-shaped: `{"error": {"message", "type", "param",
"code"}}`. User input only ever gets a 4xx; a 500 means a bug in larql, never a bad request."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from larql.errors import LarqlError

log = logging.getLogger("larql.server")

INVALID_REQUEST = "invalid_request_error"


class ApiError(Exception):
    """An error answered to the client as-is (status, OpenAI error body, extra headers)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, INVALID_REQUEST, param, code)


def describe_validation_error(error: Mapping[str, Any]) -> tuple[str, str | None]:
    """One pydantic error → (a message naming the field and the problem, the field)."""
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    kind = error.get("type", "")
    if kind == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON ({detail})".replace(" ()", ""), None
    if kind == "value_error":  # our own validators: their message is the whole story
        message = str(error.get("msg", "")).removeprefix("Value error, ")
        return (f"{'.'.join(loc)}: {message}" if loc else message), (loc[0] if loc else None)
    if not loc:
        if kind == "missing":
            return "the request body is missing (send a JSON object)", None
        return "the request body must be a JSON object (Content-Type: application/json)", None
    field = ".".join(loc)
    if kind == "missing":
        return f"missing required field {field!r}", loc[0]
    if kind == "extra_forbidden":
        return f"unknown field {field!r}", loc[0]
    message = str(error.get("msg", "invalid value"))
    got = error.get("input")
    shown = f" (got {json.dumps(got)})" if isinstance(got, str | int | float | bool) else ""
    return f"invalid {field!r}: {message}{shown}", loc[0]


class ErrorResponse(JSONResponse):
    """ASCII JSON: an error message may quote what the client sent, lone surrogates included."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> ErrorResponse:
        return ErrorResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> ErrorResponse:
        errors = exc.errors()
        message, param = describe_validation_error(errors[0]) if errors else ("invalid", None)
        return ErrorResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> ErrorResponse:
        message = str(exc.detail)
        kind = INVALID_REQUEST
        if exc.status_code == 404:
            message, kind = f"no such endpoint: {request.url.path}", "not_found_error"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return ErrorResponse(
            error_body(message, kind), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(LarqlError)
    async def _larql(_: Request, exc: LarqlError) -> ErrorResponse:
        return ErrorResponse(error_body(str(exc)), status_code=400)

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> ErrorResponse:
        log.exception("internal error", exc_info=exc)
        body = error_body(f"internal server error: {type(exc).__name__}", "server_error")
        return ErrorResponse(body, status_code=500)
