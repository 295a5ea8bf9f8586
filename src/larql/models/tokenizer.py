"""Tokenizers from GGUF metadata (built with `tokenizers` alone) or from `tokenizer.json`, plus
chat-template rendering and incremental detokenization for streaming.

The two GGUF recipes reproduce transformers' own conversion (406 texts, ~210k tokens each,
identical on a corpus of mixed text, code and Unicode).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
)
from tokenizers.processors import TemplateProcessing

from larql.models.errors import ModelFormatError
from larql.models.fields import Fields, show
from larql.models.gguf_file import GgufFile

# Byte-level BPE split rules by `tokenizer.ggml.pre`, where they differ from GPT-2's (which
# `ByteLevel` applies itself): (the split regex, whether text is NFC-normalised first).
# Qwen 2/3 split digits one by one and letters after a single leading non-letter.
_BPE_SPLITS: dict[str, tuple[str, bool]] = {
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        True,
    ),
}

# token_type values in GGUF
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# End-of-turn strings that stop generation whatever the model's eos id says .
STOP_STRINGS = (
    "<eos>",
    "</s>",
    "<|endoftext|>",
    "<|im_end|>",
    "<|end_of_turn|>",
    "<|end|>",  # Phi-3
    "<end_of_turn>",
    "<|end_of_text|>",
    "<|eom_id|>",
    "<|eot_id|>",
)


class ChatTemplateMissing(ModelFormatError):
    """The model ships no chat template."""


@dataclass
class TextTokenizer:
    """A `tokenizers.Tokenizer` with the model's special ids and chat template."""

    tokenizer: Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None
    stop_ids: frozenset[int] = field(default_factory=frozenset)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.id_to_token(token_id) or ""

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            raise ChatTemplateMissing(
                "this model has no chat template (a base model?); run without --chat"
            )
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        try:
            template = env.from_string(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:
            raise ModelFormatError(f"the model's chat template failed: {e}") from e

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        # The rendered template already holds every special token it wants.
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns a stream of token ids into text pieces, holding back incomplete UTF-8 (the
    `tokenizers` stream decoder: each step decodes only a short window of the latest ids, so
    a step's cost does not grow with the text)."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer.tokenizer
        self._stream = decoders.DecodeStream(skip_special_tokens=False)

    def step(self, token_id: int) -> str:
        """The text this token completes ("" while a multi-byte character is incomplete)."""
        return self._stream.step(self._tokenizer, token_id) or ""


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


def stop_ids_for(tokenizer: Tokenizer, eos_ids: tuple[int, ...]) -> frozenset[int]:
    ids = set(eos_ids)
    for text in STOP_STRINGS:
        token_id = tokenizer.token_to_id(text)
        if token_id is not None:
            ids.add(token_id)
    return frozenset(ids)


def tokenizer_from_file(path: Path, vocab_size: int) -> Tokenizer:
    """`tokenizer.json`, refused where `tokenizers` cannot read it or where its ids run past the
    model's vocabulary (an embedding row a token would not have)."""
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # `tokenizers` raises a plain Exception for every bad file
        raise ModelFormatError(f"not a tokenizer `tokenizers` can read: {e}") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    largest = max(vocab.values(), default=-1)
    if largest >= vocab_size:
        raise ModelFormatError(f"token id {largest} is past the model's vocab_size {vocab_size}")
    return tok


def tokenizer_from_gguf(gguf: GgufFile) -> Tokenizer:
    kind = gguf.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in gguf.metadata:
        raise ModelFormatError(f"{gguf.path} has no tokenizer in its metadata")
    tokens = gguf.strings("tokenizer.ggml.tokens")
    types = _token_types(gguf, len(tokens))
    try:
        if kind == "gpt2":
            return _byte_level_bpe(gguf, tokens, types)
        if kind == "llama":
            return _sentencepiece_bpe(gguf, tokens, types)
    except ModelFormatError:
        raise
    except Exception as e:  # `tokenizers` raises a plain Exception for a bad vocabulary
        raise ModelFormatError(f"its tokenizer cannot be built: {e}") from None
    raise ModelFormatError(f"GGUF tokenizer model {show(kind)} is not supported (gpt2, llama)")


def _token_types(gguf: GgufFile, count: int) -> list[int]:
    """`tokenizer.ggml.token_type`: one integer per token (all normal where absent)."""
    types = gguf.get("tokenizer.ggml.token_type")
    if types is None:
        return [_NORMAL] * count
    if not isinstance(types, np.ndarray) or types.dtype.kind not in "iu" or len(types) != count:
        raise ModelFormatError(
            f"tokenizer.ggml.token_type is {show(types)}; expected {count} integers, one per token"
        )
    return types.astype(np.int64).tolist()


def _token_at(gguf: GgufFile, key: str, tokens: list[str]) -> tuple[int, str] | None:
    """A `tokenizer.ggml.*_token_id` and its token (None where absent)."""
    index = Fields(gguf.metadata).optional_integer(key, high=len(tokens) - 1)
    return None if index is None else (index, tokens[index])


def _merge_pair(merge: str) -> tuple[str, str]:
    """A `tokenizer.ggml.merges` entry ("left right") → (left, right)."""
    left, space, right = merge.partition(" ")
    if not space:
        raise ModelFormatError(
            f"tokenizer.ggml.merges: {merge!r} is not two tokens separated by a space"
        )
    return left, right


def _byte_level_bpe(gguf: GgufFile, tokens: list[str], types: list[int]) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [_merge_pair(m) for m in gguf.strings("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=False))
    split = _BPE_SPLITS.get(str(gguf.get("tokenizer.ggml.pre", "default")))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        pattern, nfc = split
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if nfc:
            tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_added_tokens(tokens, types, _CONTROL, special=True))
    return tok


def _added_tokens(
    tokens: list[str], types: list[int], kind: int, special: bool
) -> list[AddedToken]:
    return [
        AddedToken(t, special=special, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == kind
    ]


def _sentencepiece_bpe(gguf: GgufFile, tokens: list[str], types: list[int]) -> Tokenizer:
    # llama.cpp stores whitespace-run tokens with real spaces; the vocab wants "▁".
    tokens = [t.replace(" ", "▁") for t in tokens]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    # Merges are implied by the vocab: every split of a normal or user-defined token into two
    # vocab entries, ranked by the merged token's id (what transformers does).
    merges = []
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind not in (_NORMAL, _USER_DEFINED) or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((vocab[left], vocab[right], i, left, right))
    merges.sort(key=lambda m: (m[2], m[0], m[1]))
    unknown = _token_at(gguf, "tokenizer.ggml.unknown_token_id", tokens)
    unk = unknown[1] if unknown is not None else None
    model = models.BPE(
        vocab, [(m[3], m[4]) for m in merges], unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens(_added_tokens(tokens, types, _CONTROL, special=True))
    # whitespace-run tokens (now spelled with ▁) stay ordinary vocab entries
    user = _added_tokens(tokens, types, _USER_DEFINED, special=False)
    tok.add_tokens([t for t in user if "▁" not in t.content])
    bos_token = _token_at(gguf, "tokenizer.ggml.bos_token_id", tokens)
    if gguf.get("tokenizer.ggml.add_bos_token", False) and bos_token is not None:
        bos_id, bos = bos_token
        tok.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tok


def chat_template_from_dir(directory: Path) -> str | None:
    """`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string), else
    None."""
    jinja = directory / "chat_template.jinja"
    config = directory / "tokenizer_config.json"
    try:
        if jinja.exists():
            return jinja.read_text(encoding="utf-8")
        if config.exists():
            settings = json.loads(config.read_text(encoding="utf-8"))
            template = settings.get("chat_template") if isinstance(settings, dict) else None
            return template if isinstance(template, str) else None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ModelFormatError(f"cannot read the chat template: {e}") from None
    return None
