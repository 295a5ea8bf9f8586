"""Prompts of a given length in tokens, cut from a real text (repeated when the text is short)."""

from __future__ import annotations

from larql.models.model import Model


def context_ids(model: Model, n_tokens: int, text: str) -> list[int]:
    ids = model.tokenizer.encode(text)
    if not ids:
        raise ValueError("the text encodes to no tokens")
    repeats = -(-n_tokens // len(ids))
    return (ids * repeats)[:n_tokens]
