"""turbo-quant's and kv-quant's CPU decode step in one compiled call
(`kv/turbo_quant/coded_layers`) against the same engine stepping layer by layer (the compiled
attention and encoding a layer at a time), on the default model as `larql run` loads it: the
same hidden rows, the same tokens and the same stored bytes, alone and in a batch."""

from __future__ import annotations

import pytest
import torch

import larql.kv.turbo_quant.engine as engine_module
from helpers import torch_threads
from larql.data import default_text
from larql.harness.contexts import context_ids
from larql.inference.batching import decode_batch
from larql.inference.ffn.policy import build_ffn
from larql.inference.fused_layer import layer_arguments
from larql.inference.layer import final_logits
from larql.inference.linear import model_block_rows
from larql.kv import parse_engine
from larql.kv.snapshots import State, load_state_dir
from larql.kv.turbo_quant.coded_layers import CODE_OLDEST, coded_layers_step
from larql.models import Model, load_model
from tiny_models import build_tiny_model, random_ids


def _state(engine) -> list[list[torch.Tensor]]:
    """Every layer's stored parts: sinks, codes, recent rows (and their int8 scales)."""
    parts = []
    for store in engine._layers:
        layer = [p.rows for p in (store.sinks, store.codes, store.recent.codes) if len(p)]
        if store.recent.bits == 8 and len(store.recent):
            layer.append(store.recent.scales.rows)
        parts.append(layer)
    return parts


def _run(model: Model, spec: str, prompt: int, steps: int, fused: bool, monkeypatch):
    """The engine's hidden rows and stored parts after `steps` greedy decode steps; counts the
    steps the one call took."""
    calls: list[bool] = []

    def counted(*args):
        out = coded_layers_step(*args) if fused else None
        calls.append(out is not None)
        return out

    monkeypatch.setattr(engine_module, "coded_layers_step", counted)
    ffn = build_ffn(model)
    engine = parse_engine(spec).build(model)
    h = engine.prefill(model, ffn, context_ids(model, prompt, default_text()))
    rows = []
    for _ in range(steps):
        token = int(final_logits(model, h[-1:]).argmax())
        h = engine.decode_step(model, ffn, token)
        rows.append(h)
    return torch.cat(rows), _state(engine), sum(calls)


@pytest.mark.parametrize(
    ("spec", "prompt", "in_one_call"),
    [
        ("turbo-quant", 60, 6),  # the oldest recent row coded at every step
        pytest.param(  # long: bits=2 below holds int8 recent rows too
            "turbo-quant:bits=3", 200, 6, marks=pytest.mark.long
        ),  # int8 recent rows, 3-bit codes
        ("turbo-quant:bits=2", 128, 6),  # the recent rows fill up on the way: both modes
        ("turbo-quant:center=0,sinks=0,recent=0,norm=0", 30, 6),  # the new row coded at once
        ("turbo-quant:recent=100", 20, 6),  # no codes yet: the new row joins the recent ones
        ("turbo-quant:sinks=8", 5, 3),  # the sinks fill layer by layer first
        ("turbo-quant:attention=sdpa", 60, 0),  # the torch reference stays the torch path
        # kv-quant's integer codes through the same call
        ("kv-quant", 60, 6),
        pytest.param(  # long: the bits=2 rotated groups below take the same call
            "kv-quant:bits=8,group=64,rotate=1", 100, 6, marks=pytest.mark.long
        ),
        ("kv-quant:bits=2,group=64,rotate=1,recent=64,recent_bits=8,sinks=4", 64, 6),
        pytest.param(  # long: the fp8 rotated groups below encode e4m3 in the call too
            "kv-quant:format=fp8", 60, 6, marks=pytest.mark.long
        ),  # e4m3 codes, encoded in the call too
        ("kv-quant:format=fp8,group=64,rotate=1", 100, 6),
    ],
)
def test_one_call_is_the_layer_by_layer_step(
    cpu_kernels, smollm2_default: Model, spec: str, prompt: int, in_one_call: int, monkeypatch
) -> None:
    rows, state, calls = _run(smollm2_default, spec, prompt, 6, True, monkeypatch)
    want_rows, want_state, _ = _run(smollm2_default, spec, prompt, 6, False, monkeypatch)
    assert calls == in_one_call
    assert torch.equal(rows, want_rows)
    for got, want in zip(state, want_state, strict=True):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "spec",
    [
        "turbo-quant",
        # long: turbo-quant checks the same batch against each alone (codes, sinks and recent
        # rows in one call), and test_batching holds kv-quant's batched steps bit for bit
        pytest.param("turbo-quant:bits=3", marks=pytest.mark.long),
        pytest.param("kv-quant", marks=pytest.mark.long),
        pytest.param("kv-quant:format=fp8", marks=pytest.mark.long),
    ],
)
@pytest.mark.slow
def test_a_batch_in_one_call_is_each_session_alone(
    cpu_kernels, smollm2_default: Model, spec: str
) -> None:
    """Sessions of different lengths and store modes, one call a step for all of them."""
    model, ffn = smollm2_default, build_ffn(smollm2_default)
    prompts = [context_ids(model, n, default_text()) for n in (20, 90, 400)]

    def started():
        engines = [parse_engine(spec).build(model) for _ in prompts]
        firsts = [e.prefill(model, ffn, p)[-1:] for e, p in zip(engines, prompts, strict=True)]
        return engines, [int(final_logits(model, h).argmax()) for h in firsts]

    alone, tokens = started()
    want = []
    for engine, token in zip(alone, tokens, strict=True):
        rows = []
        for _ in range(4):
            h = engine.decode_step(model, ffn, token)
            token = int(final_logits(model, h).argmax())
            rows.append(h)
        want.append(torch.cat(rows))
    together, tokens = started()
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    for _ in range(4):
        h = decode_batch(together, model, ffn, tokens)
        tokens = [int(t) for t in final_logits(model, h).argmax(dim=-1)]
        for i in range(len(prompts)):
            got[i].append(h[i : i + 1])
    for rows, expected in zip(got, want, strict=True):
        assert torch.equal(torch.cat(rows), expected)
    for a, b in zip(together, alone, strict=True):
        for got_layer, want_layer in zip(_state(a), _state(b), strict=True):
            assert all(torch.equal(x, y) for x, y in zip(got_layer, want_layer, strict=True))


@pytest.mark.parametrize(
    "spec",
    [
        # long: kv-quant below splits the same call (products, attention, coding) over two
        # threads; turbo-quant's codes are held bit for bit in one call by the tests above
        pytest.param("turbo-quant", marks=pytest.mark.long),
        "kv-quant",
        # long: kv-quant above splits the same call over two threads
        pytest.param("kv-quant:format=fp8", marks=pytest.mark.long),
    ],
)
@pytest.mark.slow
def test_a_batch_on_two_threads_is_the_one_thread_batch(
    cpu_kernels, smollm2_default: Model, spec: str
) -> None:
    """The one call splits its products, attention and coding over the threads: on two, the
    same hidden rows as on one (sessions of 20, 90 and 400 tokens, 4 steps)."""
    model, ffn = smollm2_default, build_ffn(smollm2_default)
    prompts = [context_ids(model, n, default_text()) for n in (20, 90, 400)]
    runs = []
    for count in (1, 2):
        with torch_threads(count):
            engines = [parse_engine(spec).build(model) for _ in prompts]
            h = torch.cat(
                [e.prefill(model, ffn, p)[-1:] for e, p in zip(engines, prompts, strict=True)]
            )
            rows = []
            for _ in range(4):
                tokens = [int(t) for t in final_logits(model, h).argmax(dim=-1)]
                h = decode_batch(engines, model, ffn, tokens)
                rows.append(h)
            runs.append(torch.stack(rows))
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize(
    "spec",
    [
        "turbo-quant",
        # long: the prompt is standard's call for every spec; turbo-quant checks the same
        pytest.param("turbo-quant:bits=3", marks=pytest.mark.long),
        "kv-quant",
    ],
)
def test_a_prompt_in_one_call_is_standards_prefill_and_the_layer_by_layer_state(
    cpu_kernels, smollm2_default: Model, spec: str, monkeypatch
) -> None:
    """A short prompt goes through `standard`'s one compiled call: the same hidden rows as
    `standard`'s prefill, bit for bit (200 tokens, sinks, codes and recent rows all filled;
    16 where a pass of the compiled layers takes no more, without AVX-512).
    The layer-by-layer prefill (torch's attention) is within float rounding of it, and its
    first layer's stored bytes are the same."""
    model, ffn = smollm2_default, build_ffn(smollm2_default)
    ids = context_ids(model, min(200, model_block_rows(model)), default_text())
    calls: list[bool] = []
    real = engine_module.prompt_in_one_call

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(engine_module, "prompt_in_one_call", counted)
    engine = parse_engine(spec).build(model)
    h = engine.prefill_all(model, ffn, ids)
    assert calls == [True]
    assert torch.equal(h, parse_engine("standard").build(model).prefill_all(model, ffn, ids))
    monkeypatch.setattr(engine_module, "prompt_in_one_call", lambda *args: None)
    by_layer = parse_engine(spec).build(model)
    h_by_layer = by_layer.prefill_all(model, ffn, ids)
    assert (h - h_by_layer).norm() / h.norm() < 1e-3
    assert torch.equal(
        final_logits(model, h).argmax(-1), final_logits(model, h_by_layer).argmax(-1)
    )
    first, first_by_layer = _state(engine)[0], _state(by_layer)[0]
    assert all(torch.equal(a, b) for a, b in zip(first, first_by_layer, strict=True))


def test_the_call_refuses_places_outside_the_storage(cpu_kernels, smollm2_default: Model) -> None:
    model, ffn = smollm2_default, build_ffn(smollm2_default)
    engine = parse_engine("turbo-quant").build(model)
    engine.prefill(model, ffn, context_ids(model, 60, default_text()))
    store = engine._layers[0]
    codes = store.codes._data
    places = [4, 0, codes.shape[0], 0, 1, CODE_OLDEST]  # no room after the codes for one more
    h = torch.zeros(1, model.config.hidden_size)
    leading, bits = layer_arguments(model, [0], h, ffn, [60])  # type: ignore[misc]
    codec = store.layout.k_codec
    with pytest.raises(RuntimeError, match="must lie in their storage"):
        cpu_kernels.decode_layers_coded(
            *leading,
            [[codes]],
            [[store.recent.codes._data]],
            [[]],
            [[store.sinks._data]],
            [[store.mean]],
            places,
            model.config.num_heads,
            model.config.attn_scale,
            bits,
            *codec.compiled_codes(h.device),
        )


@pytest.mark.parametrize("spec", ["turbo-quant", "kv-quant"])
def test_a_restored_state_steps_in_one_call_as_the_original(
    cpu_kernels, smollm2_default: Model, spec: str, tmp_path, monkeypatch
) -> None:
    """A restored state holds equal codec objects per layer, not one shared object: it still
    takes the one call, and steps as the state it was saved from."""
    calls: list[bool] = []

    def counted(*args):
        out = coded_layers_step(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(engine_module, "coded_layers_step", counted)
    model, ffn = smollm2_default, build_ffn(smollm2_default)
    engine = parse_engine(spec).build(model)
    hidden = engine.prefill(model, ffn, context_ids(model, 100, default_text()))
    State(model, engine, hidden).save(tmp_path / "state")
    restored = load_state_dir(tmp_path / "state", model)[0].engine
    tokens = [11, 260, 3575]
    going_on = torch.cat([engine.decode_step(model, ffn, t) for t in tokens])
    assert calls == [True] * 3
    calls.clear()
    again = torch.cat([restored.decode_step(model, ffn, t) for t in tokens])
    assert calls == [True] * 3
    assert torch.equal(going_on, again)


ONE_CALL_SHAPES = {  # head widths of the scalar loop (32) and the 512-bit ones (64, 128)
    "llama-32": ("llama", dict(hidden_size=128, intermediate_size=256, head_dim=32)),
    "qwen2-64": (
        "qwen2",
        dict(
            hidden_size=128,
            intermediate_size=256,
            head_dim=64,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
    ),  # QKV biases
    "llama-128": (
        "llama",
        dict(
            hidden_size=256,
            intermediate_size=256,
            head_dim=128,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
    ),
}


@pytest.mark.parametrize("shape", list(ONE_CALL_SHAPES))
def test_one_call_on_other_architectures(cpu_kernels, shape: str, tmp_path, monkeypatch) -> None:
    """Tiny random models quantised to Q8_0 at load (so the compiled layer takes them): the
    quantised and residual engines' one call against their layer-by-layer step, bit for bit."""
    import larql.kv.residual.engine as residual_engine

    arch, dims = ONE_CALL_SHAPES[shape]
    build_tiny_model(arch, tmp_path, **dims)
    model = load_model(str(tmp_path), weights="q8_0")
    ffn = build_ffn(model)
    for spec in ("turbo-quant:recent=4,sinks=2", "kv-quant:recent=3", "markov-rs-codec:window=4"):
        runs = []
        for one_call in (True, False):
            calls: list[bool] = []
            for module, name in (
                (engine_module, "coded_layers_step"),
                (residual_engine, "_fused_rows"),
            ):
                real = getattr(module, name)

                def counted(*args, real=real, on=one_call, calls=calls):
                    out = real(*args) if on else None
                    calls.append(out is not None)
                    return out

                monkeypatch.setattr(module, name, counted)
            engine = parse_engine(spec).build(model)
            h = engine.prefill(model, ffn, random_ids(20))
            rows = []
            for _ in range(8):
                h = engine.decode_step(model, ffn, int(final_logits(model, h[-1:]).argmax()))
                rows.append(h)
            monkeypatch.undo()
            runs.append((torch.cat(rows), sum(calls)))
        assert runs[0][1] == 8 and runs[1][1] == 0, spec
        assert torch.equal(runs[0][0], runs[1][0]), spec
