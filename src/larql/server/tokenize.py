"""The served model's tokenizer over HTTP, in the shapes vLLM's server gives it: `POST /tokenize`
(text or chat messages → token ids), `POST /detokenize` (ids → text) and `GET /tokenizer_info`
(its special tokens and chat template). A client that counts or cuts tokens itself uses them
instead of a tokenizer of its own — lm-eval-harness's `tokenizer_backend=remote` does, which
is how it scores log-likelihood tasks on a model served from a GGUF file, whose tokenizer has
no Hugging Face name to download."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from larql.models.model import Model
from larql.models.tokenizer import ChatTemplateMissing
from larql.server.errors import bad_request
from larql.server.prepare import check_model_name
from larql.server.schemas import ChatMessage
from larql.server.settings import ServerSettings

TOKENIZER_ENDPOINTS = ("/tokenize", "/detokenize", "/tokenizer_info")


class TokenizeRequest(BaseModel):
    """vLLM's: `prompt` (text) or `messages` (rendered with the chat template first)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give one of 'prompt' (text) or 'messages' (a chat)")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int] = Field(max_length=2**20)


def tokenizer_info(model: Model) -> dict[str, Any]:
    tokenizer = model.tokenizer
    return {
        "tokenizer_class": "larql",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": None,  # the server pads nothing: every prompt is a session of its own
        "chat_template": tokenizer.chat_template,
        "model_max_length": model.config.max_positions,
        "vocab_size": tokenizer.vocab_size,
    }


def tokenize(body: TokenizeRequest, model: Model) -> dict[str, Any]:
    tokenizer = model.tokenizer
    if body.messages is not None:
        turns = [m.for_template() for m in body.messages]
        try:
            text = tokenizer.render_chat(turns, body.add_generation_prompt)
        except ChatTemplateMissing:
            raise bad_request(
                f"{model.name} has no chat template; send 'prompt'",
                "messages",
                "chat_template_missing",
            ) from None
        ids = tokenizer.encode(text, add_special_tokens=False)  # the template has its own
    else:
        assert body.prompt is not None
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {"count": len(ids), "max_model_len": model.config.max_positions, "tokens": ids}


def detokenize(body: DetokenizeRequest, model: Model) -> dict[str, Any]:
    vocab = model.tokenizer.vocab_size
    outside = [t for t in body.tokens if not 0 <= t < vocab]
    if outside:
        raise bad_request(
            f"token id {outside[0]} is outside the vocabulary (0..{vocab - 1})", "tokens"
        )
    return {"prompt": model.tokenizer.decode(body.tokens)}


def add_tokenizer_routes(
    app: FastAPI,
    model: Model,
    settings: ServerSettings,
    check_chars: Callable[[int, str], None],
    parse: Callable[[type[Any], bytes], Any],
) -> None:
    """The three routes; `check_chars` refuses text too long to be any prompt this server
    takes before it is tokenized, `parse` reads a body as the generation routes do."""
    info = tokenizer_info(model)

    def read_tokenize(raw: bytes) -> dict[str, Any]:
        body = parse(TokenizeRequest, raw)
        check_model_name(body.model, model, settings)
        chars = len(body.prompt or "") + sum(len(m.text()) for m in body.messages or [])
        check_chars(chars, "prompt" if body.messages is None else "messages")
        return tokenize(body, model)

    def read_detokenize(raw: bytes) -> dict[str, Any]:
        body = parse(DetokenizeRequest, raw)
        check_model_name(body.model, model, settings)
        return detokenize(body, model)

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict[str, Any]:
        return info

    @app.post("/tokenize")
    async def post_tokenize(request: Request) -> dict[str, Any]:
        return await asyncio.to_thread(read_tokenize, await request.body())

    @app.post("/detokenize")
    async def post_detokenize(request: Request) -> dict[str, Any]:
        return await asyncio.to_thread(read_detokenize, await request.body())
