"""The prefix cache: its radix tree against a brute-force search, and on the default model the
states it hands out — a prefix cut from a longer prompt's state continues exactly as a prefill
of the prefix for `standard` and the residual-stream engines (a lossless cold tier), a lossy
engine keeps what it had of the prefix, copies are independent of the cached state, and memory
stays within its bytes."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from larql.inference import prefix_cache
from larql.inference.ffn import DenseFfn
from larql.inference.generation import GenerationSession, generate
from larql.inference.prefix_cache import PrefixCache, PrefixCacheError, PrefixTree, _Entry
from larql.kv import parse_engine
from larql.models import Model

# ~120 tokens with a question: past the cuts at 100 below (in a 16-row window's cold tier)
DOC = " ".join(f"Clause {i}: the licensee keeps every notice intact." for i in range(9))
ANSWER = 3  # greedy tokens each continuation is compared over


def _ids(model: Model, question: str) -> list[int]:
    return model.tokenizer.encode(DOC + "\nQuestion: " + question + "\nAnswer:")


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


sequences = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), max_size=12)


@settings(max_examples=150, deadline=None)
@given(stored=sequences, probe=st.lists(st.integers(0, 3), max_size=10), drop=st.data())
def test_the_tree_matches_as_a_brute_force_search(stored, probe, drop) -> None:
    tree, nodes = PrefixTree(), {}
    for tokens in stored:
        node = tree.insert(tokens)
        node.entry = _Entry(tuple(tokens), None, 0, node, "s")  # type: ignore[arg-type]
        nodes[tuple(tokens)] = node
    gone = drop.draw(st.sets(st.sampled_from(sorted(nodes)))) if nodes else set()
    for tokens in gone:
        tree.remove(nodes.pop(tokens))
    kept = list(nodes)
    match = tree.match(probe, below_limit=100)
    # depth: the longest prefix of the probe that some kept sequence starts with (the tree may
    # keep more paths than the kept entries; it never forgets one)
    assert match.depth >= max((_common(list(k), probe) for k in kept), default=0)
    on_path = sorted(k for k in kept if len(k) <= len(probe) and list(k) == probe[: len(k)])
    assert sorted(e.tokens for e in match.path) == on_path
    below = sorted(
        k for k in kept if len(k) > match.depth and list(k[: match.depth]) == probe[: match.depth]
    )
    assert sorted(e.tokens for e in match.below) == below
    for entry in match.path + match.below:
        assert nodes[entry.tokens] is entry.node


# cut exactly: every row of the prefix is the one a prefill of it computes (the codec engines
# code nothing without a window)
EXACT_CUTS = [
    # long: test_a_cut_prefix_of_standard_continues_as_the_whole_prefill cuts standard the same
    # way, and test_a_session_from_the_cache_gives_the_tokens_of_a_fresh_one continues it
    pytest.param("standard", marks=pytest.mark.long),
    # long: window=16 below cuts the same engine, in its cold tier as well as its hot one
    pytest.param("markov-rs", marks=pytest.mark.long),
    "markov-rs:window=16",
    "markov-rs:kv_cache=0",
    # long: without a window it codes nothing, so its cut is markov-rs's (window=16 above);
    # the codec's own cut is test_a_residual_cut_keeps_…[markov-rs-codec:window=16]
    pytest.param("markov-rs-codec", marks=pytest.mark.long),
    "boundary-per-layer",
]


@pytest.mark.parametrize("spec", EXACT_CUTS)
def test_a_cut_prefix_continues_as_a_prefill_of_the_prefix(smollm2: Model, spec: str) -> None:
    first, second = _ids(smollm2, "What is kept?"), _ids(smollm2, "Why?")
    cache = PrefixCache(2**30, min_tokens=8)
    assert cache.store(smollm2, spec, first, _prefilled(smollm2, spec, first))
    resumed = cache.lookup(smollm2, spec, second)
    assert resumed is not None and resumed.tokens == _common(first, second) < len(second)
    fresh = _prefilled(smollm2, spec, second[: resumed.tokens])
    rest = second[resumed.tokens :]
    cut_logits, cut_tokens = _answer(smollm2, resumed.engine, rest)
    fresh_logits, fresh_tokens = _answer(smollm2, fresh, rest)
    torch.testing.assert_close(cut_logits, fresh_logits, atol=1e-4, rtol=1e-4)
    assert cut_tokens == fresh_tokens
    engine = parse_engine(spec).build(smollm2)
    whole = generate(engine, smollm2, DenseFfn(smollm2), second, ANSWER, stop_ids=frozenset())
    assert cut_tokens == whole.tokens


def _answer(model: Model, engine, rest: list[int]) -> tuple[torch.Tensor, list[int]]:  # type: ignore[no-untyped-def]
    """`rest` after the state `engine` holds → the first pick's logits [V] and ANSWER greedy
    tokens."""
    session = GenerationSession(
        engine, model, DenseFfn(model), rest, ANSWER, stop_ids=frozenset(), resumes=True
    )
    tokens = [session.prefill()]
    assert session.logits is not None
    logits = session.logits.clone()
    return logits, tokens + [session.step() for _ in range(ANSWER - 1)]


def test_a_cut_prefix_of_standard_continues_as_the_whole_prefill(smollm2: Model) -> None:
    ffn, first, second = DenseFfn(smollm2), _ids(smollm2, "What is kept?"), _ids(smollm2, "Why?")
    engine = parse_engine("standard").build(smollm2)
    engine.prefill(smollm2, ffn, first)
    cache = PrefixCache(2**30, min_tokens=8)
    assert cache.store(smollm2, "standard", first, engine)
    resumed = cache.lookup(smollm2, "standard", second)
    assert resumed is not None and resumed.tokens == _common(first, second) < len(second)
    with torch.inference_mode():
        cached = resumed.engine.extend(smollm2, ffn, second[resumed.tokens :])
        whole = parse_engine("standard").build(smollm2).prefill(smollm2, ffn, second)
    torch.testing.assert_close(cached, whole, atol=1e-4, rtol=1e-4)
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.tokens_saved) == (1, 0, resumed.tokens)


def test_a_session_from_the_cache_gives_the_tokens_of_a_fresh_one(smollm2: Model) -> None:
    ffn, prompt = DenseFfn(smollm2), _ids(smollm2, "Which notice?")
    cache = PrefixCache(2**30, min_tokens=8)
    engine = parse_engine("standard").build(smollm2)
    fresh = generate(engine, smollm2, ffn, prompt, ANSWER, stop_ids=frozenset()).tokens
    cache.store(smollm2, "standard", prompt, _prefilled(smollm2, "standard", prompt))
    for _ in range(2):  # twice from the same cached state: the first run must not change it
        resumed = cache.lookup(smollm2, "standard", prompt)
        assert resumed is not None and resumed.tokens == len(prompt) - 1
        session = GenerationSession(
            resumed.engine,
            smollm2,
            ffn,
            prompt[resumed.tokens :],
            ANSWER,
            stop_ids=frozenset(),
            resumes=True,
        )
        tokens = [session.prefill()] + [session.step() for _ in range(ANSWER - 1)]
        assert tokens == fresh


@pytest.mark.slow
def test_a_lossy_engine_keeps_its_coded_rows_of_the_prefix(smollm2: Model) -> None:
    spec, prompt = "turbo-quant:bits=4", _ids(smollm2, "What is kept?")
    engine = _prefilled(smollm2, spec, prompt)
    cut = engine.fork_prefix(smollm2, 100)
    assert cut is not None and cut.position == 100
    for layer in (0, smollm2.config.num_layers - 1):
        assert cut.stored_rows(layer) == 100  # type: ignore[attr-defined]
        codes = cut.stored_codes(layer)  # type: ignore[attr-defined]
        full = engine.stored_codes(layer)  # type: ignore[attr-defined]
        assert torch.equal(codes, full[: codes.shape[0]])
    ffn = DenseFfn(smollm2)
    session = GenerationSession(
        cut, smollm2, ffn, prompt[100:], 2, stop_ids=frozenset(), resumes=True
    )
    assert len([session.prefill(), session.step()]) == 2
    assert engine.position == len(prompt)  # the original is untouched


@pytest.mark.parametrize(
    "spec",
    [
        # long: markov-rs-codec:window=16 below cuts the same two tiers (its cold rows coded)
        pytest.param("markov-rs:window=16", marks=pytest.mark.long),
        "markov-rs-codec:window=16",
    ],
)
def test_a_residual_cut_keeps_its_cold_rows_as_they_are_stored(smollm2: Model, spec: str) -> None:
    prompt = _ids(smollm2, "What is kept?")
    engine = _prefilled(smollm2, spec, prompt)
    store = engine.store
    assert store.cold_len == len(prompt) - 16
    for tokens, hot in ((100, 0), (len(prompt) - 6, 10)):  # a cut in the cold tier, in the hot
        cut = engine.fork_prefix(smollm2, tokens)
        assert cut is not None and cut.position == tokens
        again = cut.fork(smollm2)  # a cut's split (fewer hot rows than the window) forks too
        for copy in (cut, again):
            kept = copy.store
            assert (kept.cold_len, kept.hot_len) == (tokens - hot, hot)
            for layer in (0, smollm2.config.num_layers - 1):
                cold = store.cold_rows(layer)[: tokens - hot]
                assert torch.equal(kept.cold_rows(layer), cold)  # coded rows stay as coded
                if hot:
                    assert torch.equal(kept.hot_rows(layer), store.hot_rows(layer)[:hot])
                assert kept.kv is not None and store.kv is not None
                assert torch.equal(kept.kv[layer].keys, store.kv[layer].keys[:, :tokens])
    assert engine.position == len(prompt) and store.cold_len == len(prompt) - 16
    ffn = DenseFfn(smollm2)
    session = GenerationSession(
        cut, smollm2, ffn, prompt[cut.position :], 2, stop_ids=frozenset(), resumes=True
    )
    assert len([session.prefill(), session.step()]) == 2
    assert (cut.store.cold_len, cut.store.hot_len) == (len(prompt) + 1 - 16, 16)


def test_least_recently_used_states_go_first_within_the_bytes(smollm2: Model) -> None:
    prompts = [_ids(smollm2, q) for q in ("One?", "Two, then?")]
    engines = [_prefilled(smollm2, "standard", p) for p in prompts]
    one = engines[0].fork_prefix(smollm2, len(prompts[0]))
    assert one is not None
    size = one.memory().total
    cache = PrefixCache(int(size * 1.5), min_tokens=8)
    assert cache.store(smollm2, "standard", prompts[0], engines[0])
    assert cache.store(smollm2, "standard", prompts[1], engines[1])
    stats = cache.stats()
    assert stats.entries == 1 and stats.evictions == 1 and stats.bytes <= cache.max_bytes
    resumed = cache.lookup(smollm2, "standard", prompts[1] + [13])
    assert resumed is not None and resumed.tokens == len(prompts[1])
    assert cache.lookup(smollm2, "turbo-quant", prompts[1]) is None  # another engine's tree
    assert PrefixCache(0).lookup(smollm2, "standard", prompts[1]) is None
    assert not PrefixCache(2**30).store(smollm2, "standard", prompts[0][:4], engines[0])


def test_one_cache_one_model(smollm2: Model, smollm2_f64: Model) -> None:
    cache = PrefixCache(2**20)
    cache.lookup(smollm2, "standard", [1, 2, 3])
    with pytest.raises(PrefixCacheError, match="one model"):
        cache.lookup(smollm2_f64, "standard", [1, 2, 3])
    with pytest.raises(PrefixCacheError, match=">= 0"):
        PrefixCache(-1)


def _prefilled(model: Model, spec: str, prompt: list[int]):  # type: ignore[no-untyped-def]
    engine = parse_engine(spec).build(model)
    with torch.inference_mode():
        engine.prefill(model, DenseFfn(model), prompt)
    return engine


@pytest.mark.slow
def test_the_api_starts_from_the_cache_and_says_so(smollm2: Model) -> None:
    import larql

    cache = larql.PrefixCache(2**30)
    prompts = [DOC + "\nQuestion: What is kept?\nAnswer:", DOC + "\nQuestion: Why?\nAnswer:"]
    runs = [
        larql.generate(smollm2, "standard", p, max_new_tokens=2, prefix_cache=cache)
        for p in prompts
    ]
    plain = larql.generate(smollm2, "standard", prompts[1], max_new_tokens=2)
    assert runs[0].cached_prompt_tokens == 0 and runs[1].cached_prompt_tokens > 100
    assert runs[1].token_ids == plain.token_ids and runs[1].prompt_ids == plain.prompt_ids


def test_the_api_resumes_an_eviction_from_a_state_along_the_document(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`generate` with a cache takes an eviction's prompt in parts and leaves a state at each
    boundary: the second question resumes from the last before the prompts part, takes the
    rest as its next parts and answers as a run without the cache."""
    import larql

    monkeypatch.setattr(prefix_cache, "PART_STATES_EVERY", 48)
    spec, cache = "snapkv:keep=0.5,window=4", larql.PrefixCache(2**30)
    prompts = [DOC + "\nQuestion: What is kept?\nAnswer:", DOC + "\nQuestion: Why?\nAnswer:"]
    runs = [
        larql.generate(smollm2, spec, p, max_new_tokens=ANSWER, prefix_cache=cache) for p in prompts
    ]
    held = runs[1].cached_prompt_tokens
    assert runs[0].cached_prompt_tokens == 0 and held > 0 and held % 48 == 0
    plain = larql.generate(smollm2, spec, prompts[1], max_new_tokens=ANSWER)
    assert runs[1].token_ids == plain.token_ids


def test_a_prompt_in_parts_keeps_its_first_and_deepest_copies(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt taken in parts offers a copy at each boundary; the cache keeps the first
    (a shared start) and the deepest, dropping those passed. Later questions resume from the
    deepest."""
    import larql

    monkeypatch.setattr(prefix_cache, "PART_STATES_EVERY", 48)
    spec, cache = "snapkv:keep=0.5,window=4", larql.PrefixCache(2**30)
    doc = DOC + " " + DOC  # ~220 tokens: boundaries at 48, 96, 144 and 192
    prompts = [doc + "\nQuestion: What is kept?\nAnswer:", doc + "\nQuestion: Why?\nAnswer:"]
    first = larql.generate(smollm2, spec, prompts[0], max_new_tokens=1, prefix_cache=cache)
    boundaries = (len(first.prompt_ids) - 1) // 48
    assert boundaries >= 4
    assert cache.stats().entries == 3  # the first copy, the deepest and the whole prompt's
    second = larql.generate(smollm2, spec, prompts[1], max_new_tokens=1, prefix_cache=cache)
    assert second.cached_prompt_tokens == 48 * boundaries
    third = larql.generate(smollm2, spec, doc + "\nAnother?", max_new_tokens=1, prefix_cache=cache)
    assert third.cached_prompt_tokens == 48 * boundaries


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("spec", ["standard", "turbo-quant:bits=4,attention=sdpa"])
def test_a_cut_prefix_on_cuda_continues_as_a_fresh_prompt(spec: str) -> None:
    import larql

    model = larql.load_model("smollm2-135m", dtype=torch.float32, weights="float", device="cuda")
    prompts = [DOC + "\nQuestion: What is kept?\nAnswer:", DOC + "\nQuestion: Why?\nAnswer:"]
    cache = larql.PrefixCache(2**30)
    runs = [larql.generate(model, spec, p, max_new_tokens=6, prefix_cache=cache) for p in prompts]
    plain = larql.generate(model, spec, prompts[1], max_new_tokens=6)
    assert runs[1].cached_prompt_tokens > 100
    if spec == "standard":  # exact: the tokens of a run without the cache
        assert runs[1].token_ids == plain.token_ids
    else:  # the question attends what the engine kept of the cached document
        assert runs[1].token_ids and plain.token_ids


# evictions (and one composed with a quantiser): their rows depend on the whole prompt, so the
# cache keeps states along a prompt taken in parts instead of cutting one back
PART_WAY = [
    # long: the server's and the API's tests resume snapkv's part-way copies
    pytest.param("snapkv:keep=0.5,window=4", marks=pytest.mark.long),
    # long: h2o's copy is the same fork_part_way, its own statistics copied as any policy's
    pytest.param("h2o:keep=0.5", marks=pytest.mark.long),
    "keydiff:keep=0.5+kv-quant:bits=4",
]


@pytest.mark.parametrize("spec", PART_WAY)
def test_a_part_way_copy_goes_on_as_the_engine_it_came_from(smollm2: Model, spec: str) -> None:
    """At a part boundary of a prompt taken in parts, the copy `fork_part_way` makes holds the
    parts' exact K/V (its bytes counted), takes the rest as the engine would and ends in the
    state the same parts leave without a copy; the engine it came from goes on unchanged by
    it; the cache resumes a prompt sharing those tokens from the copy."""
    ffn, ids = DenseFfn(smollm2), _ids(smollm2, "What is kept?")
    parts = parse_engine(spec).build(smollm2)
    with torch.inference_mode():
        parts.prefill_part(smollm2, ffn, ids[:40], more=True)
        parts.prefill_part(smollm2, ffn, ids[40:80], more=True)
        copy = parts.fork_part_way(smollm2)
        assert copy is not None and copy.position == 80 and copy.prompt_part_way()
        assert copy.memory().state == parts.memory().state > 0
        # the same parts without a copy: parts attend over earlier rows through other products
        # than one causal pass (on an AVX-512 machine a rounding apart, ~0.03 at the next step
        # for keydiff alone), and an eviction's choice or a 4-bit code can turn on a rounding
        alone = parse_engine(spec).build(smollm2)
        for part, more in ((ids[:40], True), (ids[40:80], True), (ids[80:-1], False)):
            alone.prefill_part(smollm2, ffn, part, more=more)
        assert alone.finish_prompt(sys.maxsize)
        expected = alone.decode_step(smollm2, ffn, ids[-1])
        for engine in (copy, parts):  # the copy first: the engine must not have moved
            engine.prefill_part(smollm2, ffn, ids[80:-1], more=False)
            assert engine.finish_prompt(sys.maxsize)
            got = engine.decode_step(smollm2, ffn, ids[-1])
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    cache = PrefixCache(2**30, min_tokens=8)
    engine = parse_engine(spec).build(smollm2)
    with torch.inference_mode():
        engine.prefill_part(smollm2, ffn, ids[:80], more=True)
    assert cache.store_part_way(smollm2, spec, ids[:80], engine)
    other = _ids(smollm2, "Why?")
    resumed = cache.lookup(smollm2, spec, other)
    assert resumed is not None and resumed.tokens == 80 and resumed.engine.prompt_part_way()
