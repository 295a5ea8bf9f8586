"""Token log-probabilities in the two OpenAI shapes: the legacy completions one (`tokens`,
`token_logprobs`, `top_logprobs` as {token: logprob} maps, `text_offset`) and chat's
(`content`: one {token, logprob, bytes, top_logprobs} per token).

A token's string is its own decoded text (special tokens by name); its `text_offset` is where
its text starts in the text the response returns (echoed prompt included), as a stream decoder
hands the text out: a token that ends inside a multi-byte character contributes nothing and the
next one carries the character. A token whose text is not in the response (a stop token, the
text of a stop string) has the offset of the text's end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from larql.inference.logprobs import TokenLogprob
from larql.models.tokenizer import TextTokenizer

MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (as vLLM's default)


@dataclass(frozen=True)
class Entry:
    """One token of a response: what it is, its log-probability (None for a prompt's first
    token, which nothing predicts) and where its text starts."""

    token_id: int
    record: TokenLogprob | None
    offset: int

    def shifted(self, by: int) -> Entry:
        return Entry(self.token_id, self.record, self.offset + by)


def prompt_entries(
    tokenizer: TextTokenizer, ids: Sequence[int], records: Sequence[TokenLogprob]
) -> tuple[str, list[Entry]]:
    """The echoed prompt (its ids decoded, special tokens kept) and one entry per prompt token;
    `records` are the log-probabilities of ids[1:]."""
    text = tokenizer.decode(list(ids))
    decoder = tokenizer.stream_decoder()
    offsets = []
    emitted = 0
    for token in ids:
        offsets.append(min(emitted, len(text)))
        emitted += len(decoder.step(token))
    scored: list[TokenLogprob | None] = [None, *records] if records else [None] * len(ids)
    return text, [Entry(t, r, o) for t, r, o in zip(ids, scored, offsets, strict=True)]


class GeneratedTrack:
    """The generated tokens' entries, handed out once their text has been (their offsets are
    final then): the stream's chunks carry the tokens whose text they carry."""

    def __init__(self) -> None:
        self._waiting: list[tuple[int, TokenLogprob, int, int]] = []  # id, record, start, end

    def add(self, token_id: int, record: TokenLogprob, start: int, end: int) -> None:
        """A token whose text spans characters start..end of the generated text as decoded."""
        self._waiting.append((token_id, record, start, end))

    def ready(self, sent: int, final: bool = False) -> tuple[Entry, ...]:
        """Entries whose text lies within the `sent` characters handed out (all when final)."""
        done = [w for w in self._waiting if final or w[3] <= sent]
        self._waiting = self._waiting[len(done) :] if not final else []
        return tuple(Entry(t, r, min(start, sent)) for t, r, start, _ in done)


class LogprobFormat:
    """Entries → the JSON a client reads, for completions (legacy) or chat."""

    def __init__(self, tokenizer: TextTokenizer, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self._strings: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        if token_id not in self._strings:
            self._strings[token_id] = self.tokenizer.decode([token_id])
        return self._strings[token_id]

    def render(self, entries: Sequence[Entry]) -> dict[str, Any]:
        return self._chat(entries) if self.chat else self._legacy(entries)

    def _legacy(self, entries: Sequence[Entry]) -> dict[str, Any]:
        def top(record: TokenLogprob | None) -> dict[str, float] | None:
            if record is None:
                return None
            alternatives: dict[str, float] = {}
            for token_id, logprob in record.top:  # best first: a string two ids share keeps
                alternatives.setdefault(self.token(token_id), logprob)  # the higher
            return alternatives

        return {
            "tokens": [self.token(e.token_id) for e in entries],
            "token_logprobs": [None if e.record is None else e.record.logprob for e in entries],
            "top_logprobs": [top(e.record) for e in entries],
            "text_offset": [e.offset for e in entries],
        }

    def _chat(self, entries: Sequence[Entry]) -> dict[str, Any]:
        content = []
        for e in entries:
            assert e.record is not None  # chat never echoes the prompt
            content.append(
                {
                    **self._one(e.token_id, e.record.logprob),
                    "top_logprobs": [self._one(t, lp) for t, lp in e.record.top],
                }
            )
        return {"content": content}

    def _one(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
