"""How a prompt enters the model: text (or one chat turn) → token ids, checked against the
model's context. `larql run`, `larql walk` and the Python API read prompts this way."""

from __future__ import annotations

from larql.errors import LarqlError
from larql.models.model import Model


class ContextOverflow(LarqlError):
    """The prompt does not fit the model's context."""


def encode_prompt(model: Model, text: str, chat: bool = False) -> list[int]:
    """`text` as token ids; with `chat`, wrapped as one user turn in the model's chat template."""
    if chat:
        return model.tokenizer.encode_chat([{"role": "user", "content": text}])
    return model.tokenizer.encode(text)


def check_context(model: Model, prompt_tokens: int) -> None:
    """Refuse a prompt that leaves no room for one new token in the model's context."""
    limit = model.config.max_positions
    if prompt_tokens >= limit:
        raise ContextOverflow(
            f"the prompt is {prompt_tokens} tokens; {model.name}'s context is {limit} tokens "
            "(the prompt must leave room for at least one new token)"
        )
