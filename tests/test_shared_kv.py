"""K/V shared across layers (Gemma 4's last `num_kv_shared_layers`): a sharing layer attends
over what its source layer attended over in the same step and keeps no K/V of its own, in every
engine — its buffers, stores and residuals stay empty, its static buffers are its source's —
and sessions batched give their tokens alone. Logits against transformers are in
test_hf_oracle (`gemma4_shared`), every live engine in test_engine_compliance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import greedy_streams, teacher_forced
from larql.inference.ffn import DenseFfn
from larql.inference.generation import teacher_forced_logits
from larql.kv import parse_engine
from larql.kv.standard import StandardEngine
from larql.models import Model, load_model
from tiny_models import build_tiny_model, random_ids

PROMPTS = ["w3 w4 w5 w6 w7 w8 w9", "w10 w11 w12", "w13 w14 w15 w16 w17"]
SHARING = (4, 5)  # the tiny model's last two layers: sources 3 (sliding) and 2 (full)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Model:
    pytest.importorskip("transformers")
    directory: Path = tmp_path_factory.mktemp("gemma4-shared")
    build_tiny_model("gemma4_shared", directory)
    return load_model(str(directory))


def test_the_config_names_each_sharing_layers_source(shared: Model) -> None:
    cfg = shared.config
    assert [cfg.kv_source_of(layer) for layer in range(cfg.num_layers)] == [None] * 4 + [3, 2]
    assert [cfg.intermediate_size_of(layer) for layer in SHARING] == [2 * cfg.intermediate_size] * 2
    own = sum(2 * cfg.kv_dim_of(layer) for layer in range(4))
    assert cfg.kv_bytes_per_token(2) == own * 2


@pytest.mark.parametrize("spec", ["standard", "standard:window=4", "turbo-quant"])
def test_sessions_batched_give_their_tokens_alone(spec: str, shared: Model) -> None:
    def engines() -> list:
        return [parse_engine(spec).build(shared) for _ in PROMPTS]

    alone_tokens, alone_logits = greedy_streams(shared, engines(), PROMPTS, 6, batched=False)
    batched_tokens, batched_logits = greedy_streams(shared, engines(), PROMPTS, 6, batched=True)
    assert batched_tokens == alone_tokens
    # turbo-quant: a batched projection's rounding can move a coded value across a cell edge
    tolerance = 1e-3 if spec.startswith("turbo") else 1e-4
    assert torch.allclose(batched_logits, alone_logits, atol=tolerance, rtol=0)


def test_static_path_gives_the_eager_logits_and_holds_each_buffer_once(shared: Model) -> None:
    ids = random_ids(16, seed=5)
    eager = teacher_forced(shared, "standard", ids, 6)
    engine = StandardEngine(static=True)
    static = teacher_forced_logits(engine, shared, DenseFfn(shared), ids, 6)
    assert (static - eager).abs().max().item() < 1e-4
    cache = engine.fast_path
    assert cache is not None
    for layer in SHARING:
        source = shared.config.kv_source_of(layer)
        assert cache.layer_buffers(layer)[0] is cache.layer_buffers(source)[0]
    capacity = cache.layer_buffers(0)[0].shape[1]
    own = sum(2 * shared.config.kv_dim_of(layer) * capacity * 4 for layer in range(4))
    assert engine.memory().total == own


@pytest.mark.parametrize("spec", ["standard", "snapkv:budget=8", "windowed-checkpoint:window=5"])
def test_a_sharing_layer_keeps_no_rows(spec: str, shared: Model) -> None:
    engine = parse_engine(spec).build(shared)
    with torch.inference_mode():
        engine.prefill(shared, DenseFfn(shared), random_ids(12, seed=2))
        engine.decode_step(shared, DenseFfn(shared), 7)
    layers = engine._layers
    assert all(len(layers[layer]) == 0 for layer in SHARING)
    assert all(len(layers[layer]) > 0 for layer in range(4))


def test_markov_rs_keeps_no_residuals_for_a_sharing_layer(shared: Model) -> None:
    engine = parse_engine("markov-rs:window=4").build(shared)
    ffn = DenseFfn(shared)
    with torch.inference_mode():
        engine.prefill(shared, ffn, random_ids(12, seed=2))
        for token in (7, 8, 9):
            engine.decode_step(shared, ffn, token)
    store = engine.store
    assert all(store.columns[layer] is None for layer in SHARING)  # no residuals held
    assert store.layers == [layer for layer in range(store.num_layers) if layer not in SHARING]
    assert store.hot_len == 4 and store.cold_len > 0
    assert all(len(store.cold_rows(layer)) == store.cold_len for layer in range(4))


def test_a_replayed_window_gives_a_sharing_layer_its_sources_kv(shared: Model) -> None:
    engine = parse_engine("windowed-checkpoint:window=5").build(shared)
    with torch.inference_mode():
        engine.prefill(shared, DenseFfn(shared), random_ids(12, seed=2))
        replayed = engine.replay_window(1)
    for layer in SHARING:
        source = shared.config.kv_source_of(layer)
        assert torch.equal(replayed[layer][0], replayed[source][0])
        assert torch.equal(replayed[layer][1], replayed[source][1])
