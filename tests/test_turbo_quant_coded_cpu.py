"""turbo-quant's CPU attention over the stored 4-bit codes in place (`kv/turbo_quant/coded_cpu`):
the extension's coded-rows state against a softmax over the codec's decoded rows, and the
engine's step on the real model against the torch path that decodes the whole history."""

from __future__ import annotations

import pytest
import torch

import larql.kv.turbo_quant.engine as engine_module
from larql.data import default_text
from larql.harness.contexts import context_ids
from larql.inference.ffn import DenseFfn
from larql.inference.generation import GenerationSession, step_together
from larql.inference.linear import load_block_kernels
from larql.kv import parse_engine
from larql.kv.turbo_quant.codebook import codebook
from larql.kv.turbo_quant.codec import TurboQuantCodec
from larql.kv.turbo_quant.coded_cpu import coded_kernels
from larql.models import Model


@pytest.fixture(scope="module")
def kernels():
    built = load_block_kernels()
    if built is None or not hasattr(built, "coded_attention"):
        pytest.skip("the CPU kernels are not built")
    return built


@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "width"),
    [
        (1, 9, 3, 64),
        (37, 9, 3, 64),  # SmolLM2's heads: the 512-bit loop where AVX-512 runs
        (300, 4, 2, 128),
        (50, 8, 1, 64),  # a group of 8: the most the 512-bit loop takes
        (40, 6, 2, 32),  # another width: the scalar loop everywhere
    ],
)
def test_coded_state_is_the_softmax_over_the_decoded_rows(
    kernels, rows: int, heads: int, kv_heads: int, width: int
) -> None:
    g = torch.Generator().manual_seed(rows)
    codec = TurboQuantCodec(width, 4, norm_correction=True)
    size = codec.bytes_per_vector
    k, v = (torch.randn(rows * kv_heads, width, generator=g) * 3 for _ in range(2))
    codes = torch.cat(
        (codec.encode(k).view(rows, -1), codec.encode(v).view(rows, -1)), dim=1
    )  # [rows, K heads' vectors ; V heads']
    q = torch.randn(heads, width, generator=g)
    shift = torch.randn(heads, generator=g)
    scale = 0.125
    m, l_sum, acc = kernels.coded_attention(
        q, codes, kv_heads, codebook(width, 4).centroids, shift, scale
    )
    group = heads // kv_heads
    keys = codec.decode_rotated(codes[:, : kv_heads * size].reshape(-1, size), torch.float64)
    values = codec.decode_rotated(codes[:, kv_heads * size :].reshape(-1, size), torch.float64)
    keys = keys.view(rows, kv_heads, width).transpose(0, 1).repeat_interleave(group, 0)
    values = values.view(rows, kv_heads, width).transpose(0, 1).repeat_interleave(group, 0)
    scores = scale * torch.einsum("hd,htd->ht", q.double(), keys) + shift.double().unsqueeze(1)
    want_m = scores.amax(-1)
    weights = torch.exp(scores - want_m.unsqueeze(1))
    torch.testing.assert_close(m.double(), want_m, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l_sum.double(), weights.sum(-1), rtol=1e-5, atol=1e-5)
    want_acc = torch.einsum("ht,htd->hd", weights, values)
    torch.testing.assert_close(acc.double(), want_acc, rtol=1e-4, atol=1e-5)


def test_coded_attention_refuses_rows_of_another_shape(kernels) -> None:
    codes = torch.zeros(4, 100, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="a key and a value vector per K/V head"):
        kernels.coded_attention(torch.zeros(9, 64), codes, 3, torch.zeros(16), torch.zeros(9), 1.0)


SPECS = ["turbo-quant", "turbo-quant:center=0,sinks=0,recent=0"]


@pytest.mark.parametrize("spec", SPECS)
def test_the_step_over_codes_is_the_step_over_the_decoded_history(
    kernels, spec: str, smollm2: Model, monkeypatch
) -> None:
    """Every layer's attention output of three decode steps after a 200-token prompt, both
    ways on the same state: within float32 rounding of each other."""
    ids = context_ids(smollm2, 200, default_text())
    original = engine_module.TurboQuantEngine._attend_and_share
    gaps: list[float] = []

    def both(self, model, layer, q, k, v, rotation, shared):
        store = self._layers[layer]
        assert engine_module.coded_kernels(model, layer, store, rotation, shared) is not None
        got = original(self, model, layer, q, k, v, rotation, shared)
        keys, values = self._history_with_row(model, layer, k, v, rotation)
        want = self._attend_in_basis(model, layer, q, keys, values, rotation)
        gaps.append(((got - want).abs().max() / want.abs().max()).item())
        return want

    monkeypatch.setattr(engine_module.TurboQuantEngine, "_attend_and_share", both)
    session = GenerationSession(parse_engine(spec).build(smollm2), smollm2, DenseFfn(smollm2),
                                ids, 8, stop_ids=frozenset())  # fmt: skip
    session.prefill()
    for _ in range(3):
        session.step()
    assert len(gaps) == 3 * smollm2.config.num_layers
    assert max(gaps) < 2e-5


def test_batched_steps_over_codes_equal_each_session_alone(kernels, smollm2: Model) -> None:
    prompts = [context_ids(smollm2, n, default_text()) for n in (40, 90)]
    ffn = DenseFfn(smollm2)

    def sessions():
        made = [GenerationSession(parse_engine("turbo-quant").build(smollm2), smollm2, ffn, p,
                                  8, stop_ids=frozenset()) for p in prompts]  # fmt: skip
        for s in made:
            s.prefill()
        return made

    alone = sessions()
    tokens_alone = [[s.step() for _ in range(4)] for s in alone]
    together = sessions()
    tokens_together = [[], []]
    for _ in range(4):
        for i, token in enumerate(step_together(together)):
            tokens_together[i].append(token)
    assert tokens_together == tokens_alone


def test_the_torch_path_keeps_what_the_kernel_does_not_cover(smollm2: Model, smollm2_f64) -> None:
    ids = context_ids(smollm2, 60, default_text())
    for model, spec in ((smollm2, "turbo-quant:bits=3"), (smollm2_f64, "turbo-quant")):
        engine = parse_engine(spec).build(model)
        engine.prefill(model, DenseFfn(model), ids)
        rotation = engine._rotation(model.device, 0)
        shared = engine_module.SharedKv(model.config)
        assert coded_kernels(model, 0, engine._layers[0], rotation, shared) is None


def test_attention_sdpa_keeps_the_path_that_decodes(smollm2: Model, monkeypatch) -> None:
    """`attention=sdpa` is the torch reference: it decodes the rows even where the kernel runs."""
    calls: list[int] = []
    original = engine_module.attend_coded

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine_module, "attend_coded", counted)
    ids = context_ids(smollm2, 60, default_text())
    for spec, expected in (("turbo-quant:attention=sdpa", 0), ("turbo-quant", 30)):
        calls.clear()
        session = GenerationSession(parse_engine(spec).build(smollm2), smollm2,
                                    DenseFfn(smollm2), ids, 4, stop_ids=frozenset())  # fmt: skip
        session.prefill()
        session.step()
        assert len(calls) == expected
