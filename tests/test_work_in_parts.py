"""Work in bounded parts is the work of one call, in float64: a prompt put in a part at a time
(`Engine.prefill_part`, wherever `takes_prompt_in_parts`) gives the rows and the state of one
whole prefill (on a tiny random Llama: the relation is the engines' bookkeeping, not the
model's numbers), and a decode step taken in parts (`decode_step_parts`: the engines whose step
recomputes from the whole context) the hidden row of one whole step (on the real default
model, whose depth sets how many parts a residual step takes), within 1e-9 relative."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import relative_error
from larql.inference.ffn import DenseFfn
from larql.kv import parse_engine
from larql.models import Model, load_model
from tiny_models import build_tiny_model, random_ids

PROMPT = "The quick brown fox jumps over the lazy dog because it was tired of running"
TINY_PROMPT = random_ids(16)  # as many tokens as PROMPT on the default model


@pytest.fixture(scope="module")
def tiny_llama_f64(tmp_path_factory: pytest.TempPathFactory) -> Model:
    directory = tmp_path_factory.mktemp("parts-llama")
    build_tiny_model("llama", directory)
    return load_model(str(directory), dtype=torch.float64)


# long: a case whose engine takes its prompt in parts through the same code as another case
# here (the residual engines' parts; TurboQuantEngine's, which kv-quant subclasses; the
# eviction base's, which h2o, keydiff and expected-attention also check)
_SAME_PARTS = pytest.mark.long
IN_PARTS = [  # every live engine, with parameters that make its policy act on this prompt
    "standard",
    "no-cache",
    pytest.param("markov-rs:window=4", marks=_SAME_PARTS),  # as markov-rs-codec:window=4
    "markov-rs-codec:window=4",
    pytest.param("markov-rs:window=4,kv_cache=0", marks=_SAME_PARTS),  # as markov-rs-codec
    "boundary-per-layer:window=4",
    "windowed-checkpoint:window=5",
    pytest.param("turbo-quant", marks=_SAME_PARTS),  # as kv-quant
    "kv-quant",
    pytest.param("snapkv:budget=4,window=3", marks=_SAME_PARTS),  # as the eviction cases
    "h2o:budget=6,recent=2",
    pytest.param("tova:budget=6,recent=2,sinks=1", marks=_SAME_PARTS),  # as the eviction cases
    "keydiff:budget=6,recent=2,sinks=1,heads=adaptive",
    "expected-attention:budget=6,recent=2,sinks=1,queries=4",
    "expected-attention:budget=6,recent=2,sinks=3",
    "boundary-kv:chunk_tokens=4",
    "semantic-promotion:base=no-cache",
]


# coding the prompt's K/V, cutting it to what the policy keeps, or moving rows past the window
# to the cold tier (and re-deriving the K/V a lossy tier changed) goes in parts after the
# prompt (`Engine.finish_prompt`)
FINISHED_IN_PARTS = (
    "turbo-quant",
    "kv-quant",
    "markov-rs-codec",
    "boundary-per-layer",
    "snapkv",
    "h2o",
    "tova",
    "keydiff",
    "expected-attention",
)


def _parts(ids: list[int], cuts: list[int]) -> list[list[int]]:
    """ids cut into parts of the sizes in `cuts` (cycled), the last part what is left."""
    parts, done, i = [], 0, 0
    while done < len(ids):
        size = cuts[i % len(cuts)]
        parts.append(ids[done : done + size])
        done, i = done + size, i + 1
    return parts


def _check_parts(model: Model, spec: str, cuts: list[int]) -> None:
    """A prompt cut by `cuts` through `prefill_part` against one whole prefill: the same rows,
    the same position, the same next step."""
    ffn = DenseFfn(model)
    ids = TINY_PROMPT
    whole, parted = parse_engine(spec).build(model), parse_engine(spec).build(model)
    assert parted.takes_prompt_in_parts(model)
    parts = _parts(ids, cuts)
    with torch.inference_mode():
        rows = whole.prefill_all(model, ffn, ids)  # [S, H]
        got = [
            parted.prefill_part(model, ffn, part, more=i < len(parts) - 1)
            for i, part in enumerate(parts)
        ]
        assert [r.shape[0] for r in got] == [len(p) for p in parts]  # every row of every part
        assert relative_error(torch.cat(got), rows) <= 1e-9
        assert parted.position == whole.position == len(ids)
        left = 0  # parts of the work its policy left for once the prompt is whole
        while not parted.finish_prompt(1):
            left += 1
        assert (left > 0) == spec.startswith(FINISHED_IN_PARTS), left
        step = parted.decode_step(model, ffn, 11)  # the states decode alike
        assert relative_error(step, whole.decode_step(model, ffn, 11)) <= 1e-9
    if spec.startswith("boundary-kv"):  # and emit the same frames
        assert [f.token_end for f in parted.frames()] == [f.token_end for f in whole.frames()]


@pytest.mark.slow
@pytest.mark.parametrize("spec", IN_PARTS)
def test_a_prompt_in_parts_is_one_prefill(tiny_llama_f64: Model, spec: str) -> None:
    _check_parts(tiny_llama_f64, spec, [5, 1, 3])


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec",
    [
        # long: no-cache's parts are checked at fixed cuts above; h2o here takes any cut
        pytest.param("no-cache", marks=pytest.mark.long),
        "h2o:budget=6,recent=2",
    ],
)
@settings(max_examples=4, deadline=None)
@given(cuts=st.lists(st.integers(1, 9), min_size=1, max_size=3))
def test_any_cut_of_a_prompt_is_one_prefill(
    tiny_llama_f64: Model, spec: str, cuts: list[int]
) -> None:
    _check_parts(tiny_llama_f64, spec, cuts)


@pytest.mark.parametrize(("spec", "least_parts"), [("no-cache", 6), ("markov-rs:kv_cache=0", 30)])
def test_a_step_in_parts_is_one_step(smollm2_f64: Model, spec: str, least_parts: int) -> None:
    model, ffn = smollm2_f64, DenseFfn(smollm2_f64)
    ids = model.tokenizer.encode(PROMPT)
    whole, parted = parse_engine(spec).build(model), parse_engine(spec).build(model)
    with torch.inference_mode():
        whole.prefill(model, ffn, ids)
        parted.prefill(model, ffn, ids)
        assert parted.step_work() >= len(ids)  # it recomputes from the whole context
        parts = list(parted.decode_step_parts(model, ffn, 11, rows=3))
        assert len(parts) >= least_parts and all(p is None for p in parts[:-1])
        assert relative_error(parts[-1], whole.decode_step(model, ffn, 11)) <= 1e-9
        assert parted.position == whole.position == len(ids) + 1
        assert (
            relative_error(parted.decode_step(model, ffn, 12), whole.decode_step(model, ffn, 12))
            <= 1e-9
        )


def test_engines_that_keep_their_state_step_in_one_part(smollm2: Model) -> None:
    engine = parse_engine("standard").build(smollm2)
    ffn = DenseFfn(smollm2)
    with torch.inference_mode():
        engine.prefill(smollm2, ffn, smollm2.tokenizer.encode(PROMPT))
        assert engine.step_work() == 1
        assert [p is None for p in engine.decode_step_parts(smollm2, ffn, 11, rows=1)] == [False]
