"""The OpenAI request bodies larql accepts and the response shapes it sends.

Requests are validated strictly (a string is not a number, `"true"` is not a boolean); anything
OpenAI defines that larql does not implement (`n` > 1, `logprobs`, `echo`, penalties) is refused
by name instead of being silently ignored. Unknown extra fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 4


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class GenerationFields(BaseModel):
    """What completions and chat share: sampling, limits, streaming and larql's engine choice."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # not OpenAI; vLLM and llama.cpp accept it too
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch's generator takes
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    engine: str | None = None  # larql: a KV engine spec for this request
    ignore_eos: bool = False  # as vLLM: generate max_tokens whatever the model says (benchmarks)
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("must be a string or a list of strings")
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @model_validator(mode="after")
    def _no_penalties(self) -> GenerationFields:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ValueError(f"{name} is not supported (leave it out or 0)")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in stops if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[int]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        problem = "must be a string, a list of one string, or a list of token ids"
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(problem)
        if all(isinstance(v, str) for v in value) and value:
            if len(value) != 1:
                raise ValueError(f"one prompt per request, got {len(value)}")
            return value
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return value
        raise ValueError(problem)

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.logprobs is not None:
            raise ValueError("logprobs is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, str]:
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.logprobs:
            raise ValueError("logprobs is not supported")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one")
        return self

    @property
    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens


# ---------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseShape:
    """Builds the objects of one response (whole or streamed) for completions or chat."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = now()

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def whole(
        self, text: str, finish_reason: str, usage_: dict[str, int], extra: dict[str, Any]
    ) -> dict[str, Any]:
        if self.chat:
            choice = {"message": {"role": "assistant", "content": text}}
            body = self._envelope("chat.completion", [self._choice(choice, finish_reason)])
        else:
            choice = {"text": text}
            body = self._envelope("text_completion", [self._choice(choice, finish_reason)])
        return {**body, "usage": usage_, "larql": extra}

    def chunk(
        self, text: str | None, finish_reason: str | None = None, role: bool = False
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = self._choice({"delta": delta}, finish_reason)
            return self._envelope("chat.completion.chunk", [choice])
        choice = self._choice({"text": text or ""}, finish_reason)
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage_}

    @staticmethod
    def _choice(content: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}
