"""The OpenAI request bodies larql accepts and the response shapes it sends.

Requests are validated strictly (a string is not a number, `"true"` is not a boolean); anything
OpenAI defines that larql does not implement (`n` > 1, `best_of`, `suffix`, penalties) is refused
by name instead of being silently ignored. Unknown extra fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from larql.server.logprobs import MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 1024  # per stop string: far past anything a request may generate here
MAX_ENGINE_SPEC_CHARS = 1024  # the longest catalog spec, nested, is under 200


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
    # larql: a KV engine spec for this request, parsed under a request's policy (prepare.py)
    engine: str | None = Field(None, max_length=MAX_ENGINE_SPEC_CHARS)
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

    @field_validator("stop")
    @classmethod
    def _stop_lengths(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
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


Prompt = str | list[int]  # text, or token ids


def check_top_logprobs(value: int | None, name: str) -> int | None:
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(
            f"{name} must be an integer in 0..{MAX_TOP_LOGPROBS} (the most likely alternatives "
            f"to list per token), got {value}"
        )
    return value


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False  # the prompt goes first in the text (and logprobs); max_tokens may be 0
    logprobs: int | None = None  # alternatives per token (0..20): legacy `logprobs`
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        problem = (
            "must be a string, a list of strings, a list of token ids or a list of lists of "
            "token ids"
        )
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(problem)

        def ids(v: Any) -> bool:
            return isinstance(v, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in v
            )

        if ids(value):
            return value
        if value and (all(isinstance(v, str) for v in value) or all(ids(v) for v in value)):
            return value
        raise ValueError(problem)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        return check_top_logprobs(value, "logprobs")

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompts(self) -> list[Prompt]:
        """Each prompt of the request: a list of strings or of id lists is several."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], str | list):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]


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
    top_logprobs: int | None = None  # alternatives per token (0..20), with logprobs=true

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):  # declared before: validated
            raise ValueError("top_logprobs needs logprobs=true")
        return check_top_logprobs(value, "top_logprobs")

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one")
        return self

    @property
    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    @property
    def top_n(self) -> int | None:
        """Alternatives per token; None: no log-probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None


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

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One choice of a whole response."""
        if self.chat:
            content: dict[str, Any] = {"message": {"role": "assistant", "content": text}}
        else:
            content = {"text": text}
        return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}

    def whole(
        self, choices: list[dict[str, Any]], usage_: dict[str, int], extra: dict[str, Any]
    ) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(obj, choices), "usage": usage_, "larql": extra}

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = self._choice({"delta": delta}, finish_reason, logprobs)
            return self._envelope("chat.completion.chunk", [choice])
        choice = self._choice({"text": text or ""}, finish_reason, logprobs)
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage_}

    @staticmethod
    def _choice(
        content: dict[str, Any], finish_reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        return {"index": 0, **content, "logprobs": logprobs, "finish_reason": finish_reason}
