"""Build an apollo store from a text corpus (`larql apollo build-store`).

1. Tokenize the corpus (no special tokens) and cut it into consecutive windows of `window`
   tokens (the last one may be shorter).
2. Boundaries: run the model over each window on its own, from position 0, and keep the
   pre-layer residual entering layer `crystal_layer` at the window's last token (float32 [H]).
   That is exactly the row the engine's compressed forward resumes from (see `store.py`).
3. Entries — the coefficient rule. With N windows and df(t) the number of windows holding
   token t, a token is a candidate entry of a window if it occurs there, is not a special token,
   its text has a letter or digit, and it is not in every window (df < N; with N = 1 every
   token qualifies). Its coefficient is its rarity across windows, normalised to (0, 1]:

       coefficient(t) = idf(N, df(t)) / idf(N, 1),  idf(N, df) = ln((N − df + 0.5)/(df + 0.5) + 1)

   (the routing idf), so a token found in one window only gets 1.0. Each window keeps its
   `entries_per_window` best candidates — highest coefficient, then earliest position — one
   entry per distinct token, at the token's first position in the window.
   fact_id = index of the sentence the token starts in, counted over the whole corpus
   (a sentence ends at `.`, `!` or `?` followed by whitespace, or at a blank line).
4. The manifest records the model name and hidden size, so the store refuses another model.

Everything is deterministic: the same corpus, model and options give the same store.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from larql.inference.ffn import DenseFfn
from larql.inference.forward import run_layers
from larql.inference.layer import embed_rows, token_tensor
from larql.kv.apollo.routing import idf
from larql.kv.apollo.store import (
    ENTRY_DTYPE,
    STORE_VERSION,
    U16_MAX,
    ApolloStore,
    ApolloStoreError,
    ArchConfig,
    StoreManifest,
)
from larql.models.model import Model

DEFAULT_WINDOW = 128
DEFAULT_ENTRIES_PER_WINDOW = 16
DEFAULT_INJECT_COEFFICIENT = 10.0
_SENTENCE_END = re.compile(r"[.!?](?=\s)|\n\s*\n")


class StoreBuildError(ApolloStoreError):
    """Options or a corpus a store cannot be built from."""


@dataclass(frozen=True)
class BuildOptions:
    window: int = DEFAULT_WINDOW
    crystal_layer: int | None = None  # None ⇒ half the model's depth
    injection_layer: int | None = None  # None ⇒ default_injection_layer(depth)
    entries_per_window: int = DEFAULT_ENTRIES_PER_WINDOW
    residuals: bool = True  # False ⇒ an uncompressed store (full forward over window + query)


def default_crystal_layer(depth: int) -> int:
    return depth // 2


def default_injection_layer(depth: int) -> int:
    """Late, where an added token embedding still moves the output (30 of 34 in the reference
    store, ≈ 7/8 of the depth)."""
    return max(0, (7 * depth) // 8)


def build_store(model: Model, corpus: str, options: BuildOptions | None = None) -> ApolloStore:
    options = options or BuildOptions()
    depth = model.config.num_layers
    crystal = (
        default_crystal_layer(depth) if options.crystal_layer is None else options.crystal_layer
    )
    injection = (
        default_injection_layer(depth)
        if options.injection_layer is None
        else options.injection_layer
    )
    _check_options(options, crystal, injection, depth)
    ids, fact_of_token = _tokenize_with_sentences(model, corpus)
    if not ids:
        raise StoreBuildError("the corpus has no tokens")
    windows = [ids[i : i + options.window] for i in range(0, len(ids), options.window)]
    facts = [fact_of_token[i : i + options.window] for i in range(0, len(ids), options.window)]
    if len(windows) > U16_MAX + 1:
        raise StoreBuildError(
            f"the corpus makes {len(windows)} windows; a store holds at most {U16_MAX + 1} "
            "(use a larger --window)"
        )
    entries = _entries(model, windows, facts, options.entries_per_window)
    boundaries = _boundaries(model, windows, crystal) if options.residuals else None
    manifest = StoreManifest(
        version=STORE_VERSION,
        model=model.name,
        hidden_size=model.config.hidden_size,
        num_entries=len(entries),
        num_windows=len(windows),
        num_tokens=len(ids),
        entries_per_window=options.entries_per_window,
        crystal_layer=crystal,
        window_size=options.window,
        arch_config=ArchConfig(
            retrieval_layer=crystal,
            query_head=0,
            injection_layer=injection,
            inject_coefficient=DEFAULT_INJECT_COEFFICIENT,
        ),
        has_residuals=options.residuals,
    )
    return ApolloStore(
        manifest=manifest,
        window_tokens=[np.asarray(w, dtype=np.uint32) for w in windows],
        entries=entries,
        boundaries=boundaries,
    )


def _check_options(options: BuildOptions, crystal: int, injection: int, depth: int) -> None:
    if options.window < 1:
        raise StoreBuildError(f"--window must be ≥ 1, got {options.window}")
    if options.window > U16_MAX + 1:
        raise StoreBuildError(f"--window must be ≤ {U16_MAX + 1} (positions are u16)")
    if options.entries_per_window < 1:
        raise StoreBuildError(f"--entries-per-window must be ≥ 1, got {options.entries_per_window}")
    for flag, layer in (("--crystal-layer", crystal), ("--injection-layer", injection)):
        if not 0 <= layer < depth:
            raise StoreBuildError(f"{flag} {layer} is outside the model's layers 0..{depth - 1}")
    if options.residuals and injection < crystal:
        raise StoreBuildError(
            f"--injection-layer {injection} is below --crystal-layer {crystal}: the compressed "
            "forward starts at the crystal layer and would never inject"
        )


def _tokenize_with_sentences(model: Model, corpus: str) -> tuple[list[int], list[int]]:
    """Token ids of the corpus and, for each, the index of the sentence it starts in."""
    encoding = model.tokenizer.tokenizer.encode(corpus, add_special_tokens=False)
    ends = [m.end() for m in _SENTENCE_END.finditer(corpus)]
    facts = [bisect.bisect_right(ends, start) for start, _ in encoding.offsets]
    if facts and facts[-1] > U16_MAX:
        raise StoreBuildError(
            f"the corpus has {facts[-1] + 1} sentences; fact ids are u16 (at most {U16_MAX + 1})"
        )
    return list(encoding.ids), facts


def _entries(
    model: Model, windows: list[list[int]], facts: list[list[int]], per_window: int
) -> np.ndarray:
    n = len(windows)
    df = Counter(t for w in windows for t in set(w))
    special = set(model.tokenizer.stop_ids)
    if model.config.bos_token_id is not None:
        special.add(model.config.bos_token_id)
    rows: list[tuple[int, float, int, int, int]] = []
    for window_id, (tokens, window_facts) in enumerate(zip(windows, facts, strict=True)):
        first: dict[int, int] = {}
        for position, token in enumerate(tokens):
            first.setdefault(token, position)
        candidates = [
            (token, position)
            for token, position in first.items()
            if token not in special and _is_content(model, token) and (n == 1 or df[token] < n)
        ]
        scored = [(_coefficient(n, df[t]), p, t) for t, p in candidates]
        kept = sorted(scored, key=lambda c: (-c[0], c[1]))[:per_window]
        for coefficient, position, token in sorted(kept, key=lambda c: c[1]):
            rows.append((token, coefficient, window_id, position, window_facts[position]))
    return np.array(rows, dtype=ENTRY_DTYPE)


def _coefficient(num_windows: int, df: int) -> float:
    if num_windows == 1:
        return 1.0
    return idf(num_windows, df) / idf(num_windows, 1)


def _is_content(model: Model, token: int) -> bool:
    text = model.tokenizer.decode([token])
    return any(c.isalnum() for c in text)


@torch.inference_mode()
def _boundaries(model: Model, windows: list[list[int]], crystal: int) -> np.ndarray:
    """[num_windows, H] float32: the residual entering layer `crystal` at each window's last
    token, each window run alone from position 0."""
    ffn = DenseFfn(model)
    rows = []
    for tokens in windows:
        h, inputs = embed_rows(model, token_tensor(model, tokens))  # [W, H], …
        h = run_layers(model, ffn, h, 0, range(crystal), inputs=inputs)
        rows.append(h[-1].to(torch.float32).cpu().numpy())
    return np.stack(rows)
