"""`semantic-promotion` in observe mode runs its base unchanged: the same tokens and logits bit
for bit, the base's memory, and the spec refuses what is not built."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from helpers import first_layers, teacher_forced
from larql.cli.app import app
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate
from larql.kv import parse_engine
from larql.kv.spec import EngineSpecError
from larql.models import Model

PROMPT = "Alice put the red ball in the box, and Bob"


@pytest.fixture(scope="module")
def shallow(smollm2: Model) -> Model:
    """The default model's first 4 layers (real weights and tokenizer): observe mode's
    bit-for-bit relation to its base holds at any depth, at a fraction of the cost."""
    return first_layers(smollm2, 4)


@pytest.mark.parametrize("base", ["standard:window=8", "turbo-quant", "markov-rs:window=4"])
@pytest.mark.slow
def test_observe_mode_is_bit_identical_to_its_base(shallow: Model, base: str) -> None:
    ids = shallow.tokenizer.encode(PROMPT)
    wrapped = teacher_forced(shallow, f"semantic-promotion:base={base}", ids + ids[:6], len(ids))
    assert torch.equal(wrapped, teacher_forced(shallow, base, ids + ids[:6], len(ids)))
    ffn = DenseFfn(shallow)
    engine = parse_engine(f"semantic-promotion:base={base}").build(shallow)
    alone = parse_engine(base).build(shallow)
    ours = generate(engine, shallow, ffn, ids, 12, stop_ids=frozenset())
    theirs = generate(alone, shallow, ffn, ids, 12, stop_ids=frozenset())
    assert ours.tokens == theirs.tokens
    assert engine.memory() == alone.memory() and engine.position == alone.position
    assert engine.observed_prompt_tokens == len(ids) and engine.observed_steps == 11
    assert engine.info().config == f"base={parse_engine(base).spec()},mode=observe"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("semantic-promotion:mode=enforce", "mode"),
        ("semantic-promotion:base=semantic-promotion", "another engine"),
        ("semantic-promotion:base=warp-drive", "warp-drive"),
        ("semantic-promotion:base=apollo", "not for live decode"),
    ],
)
def test_the_spec_refuses_what_is_not_built(smollm2: Model, spec: str, message: str) -> None:
    with pytest.raises(EngineSpecError, match=message):
        parse_engine(spec).build(smollm2)


def test_it_runs_from_the_cli() -> None:
    result = CliRunner().invoke(
        app, ["run", PROMPT, "-n", "4", "--engine", "promotion:base=standard:window=64", "-v"]
    )
    assert result.exit_code == 0, result.output
    assert "observes standard [cpu] (window=64)" in result.stderr
