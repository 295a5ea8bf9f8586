"""The long-context tasks, generated offline and deterministically from a seed.

Every sample is a context (a haystack of real English sentences from the shipped text, cycled
when a length needs more than it holds, with the task's facts inserted at a depth), a question
appended after it, and a gold answer the model should continue with. Values are written in
double quotes and the question ends with an opening quote, so the answer is the quoted text
alone (a small model copies a quoted value far more reliably than a bare word).

Tasks: `needle-number`, `needle-word`, `needle-key` (a single needle whose value is a 5-digit
number, a word, or a hex key like `3ed2-e3dc`); `multi-key` (the asked needle among three
distractor needles with other names); `multi-value` (three values of one name, all asked, in
order); `variable-tracking` (a chain `A1 = v … A4 = A3`, the value of the last asked);
`common-words` (a word list in which one word is far the most frequent; the depth only reseeds
the list); `passage-qa` (one of the shipped licence's definitions, `"Licensor" shall mean …`,
placed at the depth in a haystack without the others, and asked back: the answer is the first
eight words of its meaning, unquoted).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache

from larql.data import default_text
from larql.models.tokenizer import TextTokenizer as Tokenizer

SINGLE_NEEDLES = ("needle-number", "needle-word", "needle-key")
TASKS = (
    *SINGLE_NEEDLES,
    "multi-key",
    "multi-value",
    "variable-tracking",
    "common-words",
    "passage-qa",
)
QUICK_TASKS = SINGLE_NEEDLES
DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192)
QUICK_LENGTHS = (512, 1024, 2048)
DEFAULT_DEPTHS = (0, 25, 50, 75, 100)
QUICK_DEPTHS = (0, 50, 100)
_WORDS = (
    "apple",
    "violin",
    "harbor",
    "lantern",
    "meadow",
    "copper",
    "falcon",
    "orchid",
    "glacier",
    "pepper",
    "saddle",
    "thimble",
    "walnut",
    "zephyr",
    "marble",
    "canyon",
    "pillow",
    "rocket",
)
_NAMES = ("Alice", "Bruno", "Chen", "Dara", "Emeka", "Freya", "Goran", "Hana")


@dataclass(frozen=True)
class Sample:
    task: str
    length: int  # the haystack's target size in tokens (the context is about this long)
    depth: int  # percent: where the asked fact sits in the haystack
    context: str
    question: str
    answer: str  # the gold continuation after the question


@dataclass(frozen=True)
class _Facts:
    sentences: tuple[str, ...]  # inserted in order, the first at the depth
    question: str
    answer: str


_PIECE_WORDS = 24  # a long sentence is cut into pieces this long, so lengths land close


_DEFINITION = re.compile(r'("[A-Z][\w ]+"(?: form| \(or "Your"\))?) shall mean ([^.;]+)')
_ANSWER_WORDS = 8


@cache
def _definitions() -> tuple[tuple[str, str], ...]:
    """The shipped licence's definitions: (the defined term as written, its meaning)."""
    text = " ".join(default_text().split())
    return tuple((m.group(1), m.group(2).strip()) for m in _DEFINITION.finditer(text))


def _passage(rng: random.Random) -> _Facts:
    term, meaning = rng.choice(_definitions())
    answer = " " + " ".join(meaning.split()[:_ANSWER_WORDS])
    return _Facts(
        (f"{term} shall mean {meaning}.",),
        f"In the text above, what does {term} mean? {term} shall mean",
        answer,
    )


@cache
def _haystack_sentences(without_definitions: bool = False) -> tuple[str, ...]:
    """The shipped text in pieces of at most _PIECE_WORDS words; `without_definitions` leaves
    out the sentences that define a term (passage-qa asks for one of them)."""
    text = " ".join(default_text().split())
    pieces = []
    sentences = (s.strip() for s in text.split(". ") if len(s.strip()) > 1)
    for sentence in sentences:
        if without_definitions and "shall mean" in sentence:
            continue
        words = (sentence + ".").split()
        pieces += [
            " ".join(words[i : i + _PIECE_WORDS]) for i in range(0, len(words), _PIECE_WORDS)
        ]
    return tuple(pieces)


def _number(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def _key(rng: random.Random) -> str:
    return "-".join("".join(rng.choice("0123456789abcdef") for _ in range(4)) for _ in range(2))


def _needle(kind: str) -> Callable[[random.Random], _Facts]:
    noun, draw = {
        "needle-number": ("number", _number),
        "needle-word": ("word", lambda rng: rng.choice(_WORDS)),
        "needle-key": ("key", _key),
    }[kind]

    def facts(rng: random.Random) -> _Facts:
        value = draw(rng)
        return _Facts(
            (f'The secret {noun} is "{value}".',),
            f'What is the secret {noun}? The secret {noun} is "',
            value,
        )

    return facts


def _multi_key(rng: random.Random) -> _Facts:
    names = rng.sample(_NAMES, 4)
    values = [_number(rng) for _ in names]
    facts = [f'The secret number for {n} is "{v}".' for n, v in zip(names, values, strict=True)]
    return _Facts(
        tuple(facts),
        f'What is the secret number for {names[0]}? The secret number for {names[0]} is "',
        values[0],
    )


def _multi_value(rng: random.Random) -> _Facts:
    name = rng.choice(_NAMES)
    values = [_number(rng) for _ in range(3)]
    return _Facts(
        tuple(f'One of the secret numbers for {name} is "{v}".' for v in values),
        f'What are all the secret numbers for {name}? They are "',
        '", "'.join(values),
    )


def _variable_tracking(rng: random.Random) -> _Facts:
    value = _number(rng)
    chain = [f"VAR A1 = {value}."] + [f"VAR A{i} = A{i - 1}." for i in range(2, 5)]
    return _Facts(tuple(chain), 'What is the value of A4? A4 = "', value)


def _facts(task: str) -> Callable[[random.Random], _Facts]:
    if task in SINGLE_NEEDLES:
        return _needle(task)
    return {
        "multi-key": _multi_key,
        "multi-value": _multi_value,
        "variable-tracking": _variable_tracking,
        "passage-qa": _passage,
    }[task]


def _token_count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(" " + text, add_special_tokens=False))


def _haystack_sample(
    tokenizer: Tokenizer, task: str, length: int, depth: int, rng: random.Random
) -> Sample:
    facts = _facts(task)(rng)
    pool = _haystack_sentences(without_definitions=task == "passage-qa")
    start = rng.randrange(len(pool))
    budget = length - sum(_token_count(tokenizer, s) for s in facts.sentences)
    hay: list[str] = []
    used = 0
    while used < budget:
        sentence = pool[(start + len(hay)) % len(pool)]
        hay.append(sentence)
        used += _token_count(tokenizer, sentence)
    at = round(depth / 100 * len(hay))
    if len(facts.sentences) == 1:
        hay.insert(at, facts.sentences[0])
    else:  # the first fact at the depth, the others spread over the rest
        later = sorted(rng.randint(at, len(hay)) for _ in facts.sentences[1:])
        for offset, (where, sentence) in enumerate(zip([at, *later], facts.sentences, strict=True)):
            hay.insert(where + offset, sentence)
    return Sample(task, length, depth, " ".join(hay), "\n\n" + facts.question, facts.answer)


def _common_words(tokenizer: Tokenizer, length: int, depth: int, rng: random.Random) -> Sample:
    common = rng.choice(_WORDS)
    others = [w for w in _WORDS if w != common]
    words: list[str] = []
    listing = ""
    while _token_count(tokenizer, listing) < length:  # batches of 10: 2 × the common word
        batch = [rng.choice(others) for _ in range(8)] + [common] * 2
        rng.shuffle(batch)
        words += batch
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
    return Sample(
        "common-words",
        length,
        depth,
        "Here is a list of words. " + listing,
        '\n\nWhich word appears most often in the list? The most common word is "',
        common,
    )


def generate_samples(
    tokenizer: Tokenizer,
    tasks: tuple[str, ...],
    lengths: tuple[int, ...],
    depths: tuple[int, ...],
    seed: int,
) -> list[Sample]:
    """One sample per task × length × depth; the same arguments give the same samples."""
    samples = []
    for task in tasks:
        for length in lengths:
            for depth in depths:
                rng = random.Random(f"{seed}:{task}:{length}:{depth}")
                if task == "common-words":
                    samples.append(_common_words(tokenizer, length, depth, rng))
                else:
                    samples.append(_haystack_sample(tokenizer, task, length, depth, rng))
    return samples


def dataset_hash(samples: list[Sample]) -> str:
    """sha256 of the samples (contexts, questions, answers), first 16 hex digits."""
    blob = json.dumps([asdict(s) for s in samples], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
