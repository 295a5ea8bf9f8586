"""Gemma 4's per-layer inputs (PLE) on every path that embeds rows: each row's per-layer input
goes with it through prefill, chunked prefill, decode alone and decode in a batch (eager and
static), and a layer that needs one and is not given it is an error, not a silent skip. The
logits against transformers are in test_hf_oracle, every live engine in
test_engine_compliance, sessions batched in test_shared_kv (its model has per-layer inputs
too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import teacher_forced
from larql.inference.errors import InvariantViolation
from larql.inference.ffn import DenseFfn
from larql.inference.generation import teacher_forced_logits
from larql.inference.layer import embed_rows, ffn_block, per_layer_inputs, token_tensor
from larql.kv import parse_engine
from larql.models import Model, load_model
from tiny_models import build_tiny_model, random_ids


@pytest.fixture(scope="module")
def ple(tmp_path_factory: pytest.TempPathFactory) -> Model:
    pytest.importorskip("transformers")
    directory: Path = tmp_path_factory.mktemp("gemma4-ple")
    build_tiny_model("gemma4_ple", directory)
    return load_model(str(directory))


def test_static_path_gives_the_eager_logits(ple: Model) -> None:
    from larql.kv.standard import StandardEngine

    ids = random_ids(16, seed=5)
    eager = teacher_forced(ple, "standard", ids, 6)
    static = teacher_forced_logits(StandardEngine(static=True), ple, DenseFfn(ple), ids, 6)
    assert (static - eager).abs().max().item() < 1e-4


def test_a_prompt_prefilled_in_chunks_is_one_prefill(ple: Model) -> None:
    ffn, ids = DenseFfn(ple), random_ids(15, seed=6)
    with torch.inference_mode():
        whole = parse_engine("standard").build(ple)
        expected = whole.prefill(ple, ffn, ids)[-1:]
        chunked = parse_engine("standard").build(ple)
        chunked.prefill(ple, ffn, ids[:5])
        chunked.extend(ple, ffn, ids[5:11])
        got = chunked.extend(ple, ffn, ids[11:])
    assert (got - expected).abs().max().item() < 1e-5 * expected.abs().max().item()


def test_hidden_rows_take_the_projection_alone(ple: Model) -> None:
    """Rows given as hidden states have no token: their per-layer input is the embedding's
    projection alone — for a token's own embedding, not what its id gives."""
    ids = token_tensor(ple, random_ids(4, seed=1))
    with torch.inference_mode():
        h, from_ids = embed_rows(ple, ids)  # [4, H], [4, L, P]
        projected = per_layer_inputs(ple, h)
    assert from_ids is not None and projected is not None
    assert projected.shape == from_ids.shape == (4, ple.config.num_layers, 4)
    assert not torch.allclose(projected, from_ids)


def test_a_layer_without_its_per_layer_input_is_an_error(ple: Model) -> None:
    h = torch.zeros(1, ple.config.hidden_size)
    with pytest.raises(InvariantViolation, match="per-layer inputs"):
        ffn_block(ple, 0, h, DenseFfn(ple))
