"""A prefix cache of engine states: a prompt that extends one seen before starts from a copy of
the state the engine held after the part they share, and only the rest goes in.

Per engine spec, a radix tree over token ids holds states at the end of the prompts that went
in (`PrefixTree`) and, for an engine that cannot cut a longer prompt's state back to a prefix
(an eviction: its rows depend on the whole prompt), copies of a prompt part-way in, at
boundaries of its parts (`store_part_way`): a prompt resuming one takes its own rest as the
next parts, so the policy compresses its whole prompt, as without the cache. A lookup walks
a new prompt down the tree as far as it matches — at most to its last token but one, so at
least one token goes in and gives the first pick — and takes the deepest state it can reach
there:
- one stored below the point where the prompt leaves the tree (a longer prompt that shares
  those tokens), cut back to them (`Engine.fork_prefix`) where the engine can do that: exact
  engines keep every row per position, so the cut state is the prefix's own;
- else the deepest one stored on the prompt's path (a prompt it extends), copied whole.

Every state handed out is a fresh fork: the stored one is never stepped, so sessions started
from it never share state. Engines that cannot fork (or are not in a state that can be forked)
are simply not cached. Memory is bounded by `max_bytes` of engine state; the least recently
used states go first.

A lossy engine's cached state is its compressed document: the tokens after the shared prefix
attend what the engine kept of it, which is the point of compressing a document once and
asking it many questions, and which differs from compressing the whole longer prompt anew.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from larql.errors import LarqlError
from larql.inference.engine import Engine
from larql.models.model import Model

# prompts shorter than this are not stored: recomputing them costs less than holding them
MIN_CACHED_TOKENS = 32


# the default cache's share of the memory its states live in (the host's, or the GPU's)
DEFAULT_SHARE = 1 / 8

# A prompt taken in parts by an engine that leaves part-way states (`fork_part_way`) offers
# one to the cache at most once per this many tokens
PART_STATES_EVERY = 256


class PrefixCacheError(LarqlError):
    """The cache was used in a way it does not support (another model, a negative size)."""


def default_size(model: Model) -> int:
    """`DEFAULT_SHARE` of the memory the model's states live in: the GPU's where it runs on
    one, else the host's."""
    if model.device.type == "cuda":
        import torch

        total = torch.cuda.get_device_properties(model.device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total * DEFAULT_SHARE)


@dataclass(eq=False)
class _Node:
    """A radix tree node: the tokens on the edge into it, its children by their edge's first
    token, and the state stored at its depth (if any)."""

    label: tuple[int, ...] = ()
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)
    entry: _Entry | None = None


@dataclass(eq=False)
class _Entry:
    tokens: tuple[int, ...]
    engine: Engine  # the cache's own copy: forked from, never stepped
    nbytes: int
    node: _Node
    spec: str
    used: int = 0  # the cache's clock when it was last stored or used
    part_way: bool = False  # a copy part-way into a prompt (`store_part_way`)


@dataclass(frozen=True)
class PrefixMatch:
    """Where a prompt meets the tree: `depth` tokens match; `path` the entries stored on those
    tokens (shallowest first); `below` entries stored deeper that share all `depth` tokens."""

    depth: int
    path: tuple[_Entry, ...]
    below: tuple[_Entry, ...]


class PrefixTree:
    """A radix tree over token ids whose nodes may hold an entry."""

    def __init__(self) -> None:
        self.root = _Node()

    def insert(self, tokens: Sequence[int]) -> _Node:
        """The node at exactly `tokens` (made, splitting an edge where needed)."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(tuple(tokens[i:]), node)
                node.children[tokens[i]] = leaf
                return leaf
            shared = _shared_length(child.label, tokens, i)
            if shared < len(child.label):
                child = self._split(child, shared)
            node, i = child, i + shared
        return node

    def match(self, tokens: Sequence[int], below_limit: int = 4) -> PrefixMatch:
        """How far `tokens` go down the tree, the entries on that path, and up to
        `below_limit` entries stored past its end that share it."""
        node, i, path = self.root, 0, []
        stop: _Node = node
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                stop = node
                break
            shared = _shared_length(child.label, tokens, i)
            i += shared
            if shared < len(child.label):
                stop = child  # the prompt leaves the tree part-way along this edge
                break
            node = stop = child
            if child.entry is not None:
                path.append(child.entry)
        below = [e for e in _entries_under(stop, below_limit + 1) if len(e.tokens) > i]
        return PrefixMatch(i, tuple(path), tuple(below[:below_limit]))

    def remove(self, node: _Node) -> None:
        """Forget the entry at `node`, and the nodes left holding nothing."""
        node.entry = None
        while node.parent is not None and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[node.label[0]]
            node = parent
        if node.parent is not None and node.entry is None and len(node.children) == 1:
            self._merge(node)

    def _split(self, child: _Node, at: int) -> _Node:
        """Put a node `at` tokens along the edge into `child` → that node."""
        parent = child.parent
        assert parent is not None
        middle = _Node(child.label[:at], parent)
        parent.children[middle.label[0]] = middle
        child.label, child.parent = child.label[at:], middle
        middle.children[child.label[0]] = child
        return middle

    def _merge(self, node: _Node) -> None:
        """A node with one child and no entry becomes part of its child's edge."""
        (child,) = node.children.values()
        parent = node.parent
        assert parent is not None
        child.label, child.parent = node.label + child.label, parent
        parent.children[child.label[0]] = child


def _shared_length(label: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    n = min(len(label), len(tokens) - start)
    for j in range(n):
        if label[j] != tokens[start + j]:
            return j
    return n


def _entries_under(node: _Node, limit: int) -> list[_Entry]:
    """Up to `limit` entries at or below `node`, shallowest first."""
    found, level = [], [node]
    while level and len(found) < limit:
        found += [n.entry for n in level if n.entry is not None]
        level = [c for n in level for c in n.children.values()]
    return found[:limit]


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    tokens_saved: int
    entries: int
    bytes: int
    evictions: int


@dataclass(frozen=True)
class CachedStart:
    """A prompt's start, from the cache: `engine` (a fresh fork) holds the state after the
    prompt's first `tokens` tokens."""

    engine: Engine
    tokens: int


class PrefixCache:
    """Engine states by the prompts that led to them, for one model, in at most `max_bytes`.

    Safe to share between threads (a lock guards the trees); the engines it hands out belong to
    the caller."""

    def __init__(self, max_bytes: int, min_tokens: int = MIN_CACHED_TOKENS) -> None:
        if max_bytes < 0:
            raise PrefixCacheError(f"a prefix cache's size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._trees: dict[str, PrefixTree] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # id(entry) → entry, oldest first
        self._bytes = 0
        self._model: Model | None = None
        self._lock = threading.Lock()
        self._hits = self._misses = self._saved = self._evictions = 0
        self._clock = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                self._hits, self._misses, self._saved, len(self._lru), self._bytes, self._evictions
            )

    def lookup(self, model: Model, spec: str, prompt: Sequence[int]) -> CachedStart | None:
        """The deepest stored state of engine `spec` that starts `prompt`, as a fresh fork
        holding at most `len(prompt) - 1` of its tokens; None (a miss) where there is none."""
        if not self.enabled or len(prompt) < 2:
            return None
        with self._lock:
            self._check_model(model)
            tree = self._trees.get(spec)
            found = self._find(model, tree, prompt[:-1]) if tree is not None else None
            if found is None:
                self._misses += 1
                return None
            entry, resumed = found
            self._touch(entry)
            self._hits += 1
            self._saved += resumed.tokens
            return resumed

    def store(
        self, model: Model, spec: str, prompt: Sequence[int], engine: Engine, from_cache: int = 0
    ) -> bool:
        """Keep a copy of `engine`'s state after `prompt` (its whole state: its position is
        the prompt's length), whose first `from_cache` tokens came from this cache → whether it
        was stored. Not stored: a state that would save fewer than `min_tokens` tokens beyond
        what the cache gives already (a question after a cached document: a copy of the whole
        document to save the question's few tokens), one too big for the cache, or one of an
        engine that cannot fork."""
        if not self.enabled or engine.position != len(prompt):
            return False
        return self._store(
            model, spec, prompt, from_cache, lambda: engine.fork_prefix(model, len(prompt))
        )

    def store_part_way(
        self, model: Model, spec: str, prompt: Sequence[int], engine: Engine
    ) -> bool:
        """`store` for a prompt still going in a part at a time, `prompt` the tokens in so far:
        a copy part-way at the same point (`Engine.fork_part_way`). An engine whose state after
        a whole prompt cannot be cut back to a prefix (an eviction) so keeps states along a
        long prompt; a later prompt sharing its start resumes from the last of them before it
        leaves and takes the rest in parts, as a prompt of its own would have."""
        if not self.enabled or engine.position != len(prompt):
            return False
        stored = self._store(
            model, spec, prompt, 0, lambda: engine.fork_part_way(model), part_way=True
        )
        if stored:
            with self._lock:
                self._drop_passed_copies(spec, prompt)
        return stored

    def _store(
        self,
        model: Model,
        spec: str,
        prompt: Sequence[int],
        from_cache: int,
        copy_of: Callable[[], Engine | None],
        part_way: bool = False,
    ) -> bool:
        """`store` with the copy `copy_of()` makes (None: no copy)."""
        if len(prompt) - from_cache < self.min_tokens:
            return False
        with self._lock:
            self._check_model(model)
            tree = self._trees.setdefault(spec, PrefixTree())
            node = tree.insert(tuple(prompt))
            if node.entry is not None:  # the same prompt again: it is fresh, nothing to copy
                self._touch(node.entry)
                return True
        copy = copy_of()  # outside the lock: it copies the state
        if copy is None:
            with self._lock:
                if node.entry is None:
                    tree.remove(node)
            return False
        nbytes = copy.memory().total
        with self._lock:
            if nbytes > self.max_bytes or node.entry is not None:
                if node.entry is None:
                    tree.remove(node)
                return node.entry is not None
            node.entry = _Entry(tuple(prompt), copy, nbytes, node, spec, part_way=part_way)
            self._lru[id(node.entry)] = node.entry
            self._touch(node.entry)
            self._bytes += nbytes
            self._evict()
            return True

    def _drop_passed_copies(self, spec: str, prompt: Sequence[int]) -> None:
        """A prompt going in parts leaves a copy at each boundary; once a deeper one is held,
        the ones it passed are rarely the deepest start of a later prompt. Dropped: the
        part-way copies on `prompt`'s path other than its first (a shared system prompt's or
        document's start) and its deepest, where no other prompt branches off (lock held).
        A prompt resuming from a copy leaves none of its own, so no copy a prompt resumed
        from is passed."""
        path = self._trees[spec].match(prompt).path
        copies = [entry for entry in path if entry.part_way]
        for entry in copies[1:-1]:
            if len(entry.node.children) <= 1:
                del self._lru[id(entry)]
                self._bytes -= entry.nbytes
                self._trees[spec].remove(entry.node)

    def clear(self) -> None:
        with self._lock:
            self._trees.clear()
            self._lru.clear()
            self._bytes = 0

    def _find(
        self, model: Model, tree: PrefixTree, tokens: Sequence[int]
    ) -> tuple[_Entry, CachedStart] | None:
        """The deepest state for `tokens`: a deeper one cut back to where they leave the tree,
        else the deepest on their path; none where they share fewer than `min_tokens` with
        the tree (lock held)."""
        match = tree.match(tokens)
        if match.depth < self.min_tokens:  # a few shared tokens save less than a copy costs
            return None
        for entry in sorted(match.below, key=lambda e: -e.used):
            engine = entry.engine.fork_prefix(model, match.depth)
            if engine is not None:
                return entry, CachedStart(engine, match.depth)
        for entry in reversed(match.path):
            if len(entry.tokens) < self.min_tokens:
                break
            engine = _copy_whole(model, entry.engine)
            if engine is not None:
                return entry, CachedStart(engine, len(entry.tokens))
        return None

    def _touch(self, entry: _Entry) -> None:
        self._clock += 1
        entry.used = self._clock
        self._lru.move_to_end(id(entry))

    def _evict(self) -> None:
        """Drop the least recently used states until the rest fit (lock held)."""
        while self._bytes > self.max_bytes and self._lru:
            _, entry = self._lru.popitem(last=False)
            self._bytes -= entry.nbytes
            self._evictions += 1
            self._trees[entry.spec].remove(entry.node)

    def _check_model(self, model: Model) -> None:
        if self._model is None:
            self._model = model
        elif self._model is not model:
            raise PrefixCacheError(
                "a prefix cache holds the states of one model; make one per model"
            )


def _copy_whole(model: Model, engine: Engine) -> Engine | None:
    """A fresh copy of a stored state, whole: a prompt's end (`fork_prefix`), or a prompt
    part-way in (`fork_part_way`: its next parts go in as they would have)."""
    if engine.prompt_part_way():
        return engine.fork_part_way(model)
    return engine.fork_prefix(model, engine.position)


class Prefilling(Protocol):
    """What `prefill_leaving_states` needs of a generation session."""

    engine: Engine
    resumes: bool

    def prefill(self) -> int: ...

    def prefill_part(self, max_tokens: int) -> int | None: ...


def prefill_leaving_states(
    session: Prefilling, cache: PrefixCache, model: Model, key: str, prompt: Sequence[int]
) -> int:
    """`session.prefill()` of a fresh `prompt` → the first token; where the engine leaves
    part-way states (`Engine.leaves_part_way_states`), in parts of `PART_STATES_EVERY` tokens,
    each boundary's state offered to `cache` under `key`."""
    engine = session.engine
    parts = engine.leaves_part_way_states and engine.takes_prompt_in_parts(model)
    if session.resumes or not cache.enabled or not parts:
        return session.prefill()
    while (token := session.prefill_part(PART_STATES_EVERY)) is None:
        if engine.prompt_part_way():
            cache.store_part_way(model, key, prompt[: engine.position], engine)
    return token
