"""Writes `licence_cloze.jsonl` beside this file: 20 multiple-choice items cut from the licence
text larql ships (larql/data), for lm-eval-harness's `local-completions` against `larql serve`
with no download (`licence_cloze.yaml` is the task; docs/SERVER.md has the command). Each item
is the start of a sentence of the licence and four endings of four words: its own and three
of other sentences; the answer's place rotates.

    .venv/bin/python benchmarks/lm_eval/make_licence_cloze.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from larql.data import default_text

ITEMS, ENDING_WORDS, CHOICES = 20, 4, 4


def sentences(text: str) -> list[list[str]]:
    """The licence's sentences of 12 to 60 words, as word lists (whitespace folded)."""
    flat = " ".join(text.split())
    found = [s.split() for s in re.split(r"(?<=[.;:])\s+", flat)]
    return [words for words in found if 12 <= len(words) <= 60]


def items(text: str) -> list[dict[str, object]]:
    pool = sentences(text)
    picked = [pool[i * len(pool) // ITEMS] for i in range(ITEMS)]
    endings = [" ".join(words[-ENDING_WORDS:]) for words in picked]
    out = []
    for i, words in enumerate(picked):
        others: list[str] = []
        for k in range(1, ITEMS):  # other sentences' endings, each text once
            ending = endings[(i + k * 7) % ITEMS]
            if ending != endings[i] and ending not in others and len(others) < CHOICES - 1:
                others.append(ending)
        label = i % CHOICES
        choices = [*others[:label], endings[i], *others[label:]]
        context = " ".join(words[:-ENDING_WORDS])
        out.append({"context": context, "choices": choices, "label": label})
    return out


def main() -> None:
    path = Path(__file__).with_name("licence_cloze.jsonl")
    rows = items(default_text())
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"{path}: {len(rows)} items")


if __name__ == "__main__":
    main()
