"""Tokenizers from GGUF metadata (built with `tokenizers` alone) or from `tokenizer.json`, plus
chat-template rendering and incremental detokenization for streaming.

The two GGUF recipes reproduce transformers' own conversion (406 texts, ~210k tokens each,
identical on a corpus of mixed text, code and Unicode).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

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


def tokenizer_from_gguf(gguf: GgufFile) -> Tokenizer:
    kind = gguf.get("tokenizer.ggml.model")
    tokens: list[str] = gguf.get("tokenizer.ggml.tokens")
    types = gguf.get("tokenizer.ggml.token_type")
    if tokens is None:
        raise ModelFormatError(f"{gguf.path.name} has no tokenizer in its metadata")
    types = [int(t) for t in types] if types is not None else [_NORMAL] * len(tokens)
    if kind == "gpt2":
        return _byte_level_bpe(gguf, tokens, types)
    if kind == "llama":
        return _sentencepiece_bpe(gguf, tokens, types)
    raise ModelFormatError(f"GGUF tokenizer model {kind!r} is not supported (gpt2, llama)")


def _byte_level_bpe(gguf: GgufFile, tokens: list[str], types: list[int]) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in gguf.get("tokenizer.ggml.merges", [])]
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
    vocab = {}
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
    unk_id = gguf.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
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
    if gguf.get("tokenizer.ggml.add_bos_token", False):
        bos_id = gguf.get("tokenizer.ggml.bos_token_id")
        if bos_id is not None:
            bos = tokens[int(bos_id)]
            tok.post_processor = TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
            )
    return tok


def chat_template_from_dir(directory: Path) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    import json

    config = directory / "tokenizer_config.json"
    if config.exists():
        template = json.loads(config.read_text()).get("chat_template")
        if isinstance(template, str):
            return template
    return None
