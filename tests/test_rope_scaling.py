"""RoPE scalings against transformers: yarn, longrope and dynamic NTK on tiny random models whose
pretraining context (16 tokens) the prompts pass, prefill and decode through the cache, greedy
tokens, and engines that recompute (no-cache, markov-rs).

dynamic and longrope rotate by the sequence length, so the oracle is stateful: transformers'
rotary module keeps the frequencies of the longest sequence it has seen, and every comparison
starts from a fresh one (`fresh_rope`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import full_forward_logits, teacher_forced
from larql.inference.errors import BackendUnavailable
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate, teacher_forced_logits
from larql.inference.layer import final_logits
from larql.kv import parse_engine
from larql.kv.standard.engine import StandardEngine
from larql.models import Model, load_model
from tiny_models import TinyModel, build_tiny_model, random_ids, rewrite_config

TOL = 1e-4
CONTEXT = 16  # the tiny models' original context; every prompt below goes past it
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]  # longrope factors, head_dim 12 → 6 frequencies
LONG = [1.0, 1.5, 2.5, 4.0, 6.0, 8.0]

ROPES: dict[str, dict[str, Any]] = {
    "yarn": dict(
        max_position_embeddings=4 * CONTEXT,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=100.0,
            factor=4.0,
            original_max_position_embeddings=CONTEXT,
        ),
    ),
    "longrope": dict(
        max_position_embeddings=8 * CONTEXT,
        rope_parameters=dict(
            rope_type="longrope",
            rope_theta=10_000.0,
            short_factor=SHORT,
            long_factor=LONG,
            original_max_position_embeddings=CONTEXT,
        ),
    ),
    "dynamic": dict(
        max_position_embeddings=CONTEXT,
        rope_parameters=dict(rope_type="dynamic", rope_theta=10_000.0, factor=4.0),
    ),
}


@pytest.fixture(scope="module", params=sorted(ROPES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp(request.param)
    built = build_tiny_model("llama", directory, **ROPES[request.param])
    built.hf_model.generation_config.eos_token_id = None  # greedy runs never stop early
    return built


def fresh_rope(hf_model: Any) -> None:
    """Forget what transformers' rotary modules learnt from earlier calls (dynamic NTK keeps
    the frequencies of the longest sequence seen until one shorter than its context)."""
    for module in hf_model.modules():
        if hasattr(module, "original_inv_freq") and hasattr(module, "max_seq_len_cached"):
            module.inv_freq = module.original_inv_freq.clone()
            module.max_seq_len_cached = module.original_max_seq_len


@torch.no_grad()
def hf_full(tiny: TinyModel, ids: list[int]) -> torch.Tensor:
    """[S, V]: one forward over the whole sequence."""
    fresh_rope(tiny.hf_model)
    return tiny.hf_logits(ids)


@torch.no_grad()
def hf_cached(tiny: TinyModel, ids: list[int], prompt_len: int) -> torch.Tensor:
    """Logits after the prompt and after each later id fed through transformers' default cache:
    [len(ids) − prompt_len + 1, V]."""
    fresh_rope(tiny.hf_model)
    out = tiny.hf_model(torch.tensor([ids[:prompt_len]]), use_cache=True)
    rows = [out.logits[0, -1]]
    for token in ids[prompt_len:]:
        out = tiny.hf_model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
        rows.append(out.logits[0, -1])
    return torch.stack(rows).float()


@torch.no_grad()
def hf_greedy(tiny: TinyModel, prompt: list[int], n: int, use_cache: bool = True) -> list[int]:
    fresh_rope(tiny.hf_model)
    out = tiny.hf_model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        use_cache=use_cache,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def larql_greedy(model: Model, spec: str, prompt: list[int], n: int) -> list[int]:
    engine = parse_engine(spec).build(model)
    ffn = DenseFfn(model)
    return generate(
        engine, model, ffn, prompt, n, stop_ids=frozenset(), max_positions=10_000
    ).tokens


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


# ------------------------------------------------------------------ prefill and cached decode


def test_prefill_past_the_context_matches_transformers(tiny: TinyModel) -> None:
    ids = random_ids(72)
    ours = full_forward_logits(load_model(str(tiny.directory)), ids)
    assert max_diff(ours, hf_full(tiny, ids)) < TOL


@pytest.mark.parametrize("prompt_len", [40, 8])  # past the context, and crossing it while decoding
def test_cached_decode_matches_transformers_cache(tiny: TinyModel, prompt_len: int) -> None:
    ids = random_ids(64, seed=2)
    ours = teacher_forced(load_model(str(tiny.directory)), "standard", ids, prompt_len)
    assert max_diff(ours, hf_cached(tiny, ids, prompt_len)) < TOL


@pytest.mark.parametrize("prompt_len", [48, 10])
@pytest.mark.slow
def test_greedy_tokens_match_transformers_generate(tiny: TinyModel, prompt_len: int) -> None:
    prompt = random_ids(prompt_len, seed=3)
    model = load_model(str(tiny.directory))
    theirs = hf_greedy(tiny, prompt, 12)  # the 10-token prompt crosses the context at step 7
    assert larql_greedy(model, "standard", prompt, 12) == theirs
    # and the logits along that path, through the cache
    ids = prompt + theirs
    ours = teacher_forced(model, "standard", ids, prompt_len)
    assert max_diff(ours, hf_cached(tiny, ids, prompt_len)) < TOL


# ------------------------------------------------------------------ engines that recompute


def test_no_cache_matches_transformers_without_cache(tiny: TinyModel) -> None:
    """no-cache re-runs the whole sequence every step: every row rotated at the current length,
    as transformers computes without a cache (for yarn, the same as with one)."""
    prompt = random_ids(10, seed=4)
    model = load_model(str(tiny.directory))
    theirs = hf_greedy(tiny, prompt, 12, use_cache=False)  # past the context from step 7
    assert larql_greedy(model, "no-cache", prompt, 12) == theirs
    ids = prompt + theirs
    ours = teacher_forced(model, "no-cache", ids, len(prompt))
    uncached = torch.stack([hf_full(tiny, ids[:n])[-1] for n in range(len(prompt), len(ids) + 1)])
    assert max_diff(ours, uncached) < TOL


def test_cache_and_no_cache_differ_only_for_length_dependent_scalings(tiny: TinyModel) -> None:
    """What the two oracles above tell apart: past the context, a cached key keeps the rotation
    of the length it was computed at."""
    ids = random_ids(24, seed=5)  # 8 steps past the context
    model = load_model(str(tiny.directory))
    cached = teacher_forced(model, "standard", ids, 8)
    recomputed = teacher_forced(model, "no-cache", ids, 8)
    if model.config.layers[0].rope.length_dependent:
        assert max_diff(cached, recomputed) > 1e-3
    else:
        assert max_diff(cached, recomputed) < TOL


def markov_hidden(
    model: Model, ids: list[int], prompt_len: int, drop_at: int
) -> Iterator[torch.Tensor]:
    """markov-rs (window 4) teacher-forced, its K/V dropped after `drop_at` fed ids so that the
    rest attends over K/V rebuilt by `recompute_kv`."""
    engine = parse_engine("markov-rs:window=4").build(model)
    ffn = DenseFfn(model)
    with torch.inference_mode():
        yield engine.prefill(model, ffn, ids[:prompt_len])
        for i, token in enumerate(ids[prompt_len:]):
            if i == drop_at:
                engine.drop_derivative()
            yield engine.decode_step(model, ffn, token)


def test_markov_rs_recompute_uses_the_same_rope(tiny: TinyModel) -> None:
    model = load_model(str(tiny.directory))
    ids = random_ids(56, seed=6)
    if model.config.layers[0].rope.length_dependent:
        with pytest.raises(BackendUnavailable, match="sequence length"):
            parse_engine("markov-rs").build(model).prefill(model, DenseFfn(model), ids)
        return
    hidden = torch.cat(list(markov_hidden(model, ids, 32, drop_at=8)))
    ours = final_logits(model, hidden)
    assert max_diff(ours, hf_cached(tiny, ids, 32)) < TOL


# ------------------------------------------------------------------ the tests can fail


def test_the_scaling_and_its_attention_factor_matter(tiny: TinyModel) -> None:
    model = load_model(str(tiny.directory))
    ids = random_ids(72)
    theirs = hf_full(tiny, ids)
    spec = model.config.layers[0].rope
    wrong = [dataclasses.replace(spec, scaling="default", attention_factor=1.0)]
    if spec.attention_factor != 1.0:
        wrong.append(dataclasses.replace(spec, attention_factor=1.0))
    if spec.scaling == "longrope":
        wrong.append(dataclasses.replace(spec, long_factor=spec.short_factor))
    for rope in wrong:
        layers = tuple(dataclasses.replace(layer, rope=rope) for layer in model.config.layers)
        altered = load_model(str(tiny.directory))
        altered.config = dataclasses.replace(altered.config, layers=layers)
        assert max_diff(full_forward_logits(altered, ids), theirs) > 1e-3, rope


def test_static_cache_step_gathers_the_same_rotation(tiny: TinyModel) -> None:
    """The static (CUDA-graph) step gathers row p of the RoPE table on the device: the rotation
    of a one-row call at p."""
    model = load_model(str(tiny.directory))
    ids = random_ids(32, seed=7)  # 24 steps, 16 of them past the context
    engine = StandardEngine(static=True)
    ours = teacher_forced_logits(engine, model, DenseFfn(model), ids, 8)
    assert engine.fast_path is not None
    assert max_diff(ours, hf_cached(tiny, ids, 8)) < TOL


def test_qwen3_yarn_in_the_transformers4_form(tmp_path: Path) -> None:
    """Qwen's long-context recipe: `rope_scaling = {"type": "yarn", ...}` beside `rope_theta`,
    on an architecture with q/k norms."""
    pytest.importorskip("transformers")
    rope = dict(ROPES["yarn"]["rope_parameters"])
    tiny = build_tiny_model(
        "qwen3", tmp_path, max_position_embeddings=4 * CONTEXT, rope_parameters=rope
    )
    theta = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    rewrite_config(tmp_path, rope_parameters=None, rope_theta=theta, rope_scaling=rope)
    model = load_model(str(tmp_path))
    assert model.config.layers[0].rope.scaling == "yarn"
    ids = random_ids(60, seed=8)
    assert max_diff(full_forward_logits(model, ids), hf_full(tiny, ids)) < TOL
    assert max_diff(teacher_forced(model, "standard", ids, 40), hf_cached(tiny, ids, 40)) < TOL
