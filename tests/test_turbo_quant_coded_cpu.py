"""turbo-quant's CPU attention over the stored codes in place (`kv/turbo_quant/coded_cpu`):
the extension's attention against a softmax over the codec's decoded rows and the exact rows,
and the engine's step on the real model (kv-quant's too) against the torch path that decodes
the whole history."""

from __future__ import annotations

import pytest
import torch

import larql.kv.kv_quant.engine as kv_engine_module
import larql.kv.turbo_quant.engine as engine_module
from helpers import first_layers
from larql.data import default_text
from larql.harness.contexts import context_ids
from larql.inference.ffn import DenseFfn
from larql.inference.generation import GenerationSession, step_together
from larql.kv import parse_engine
from larql.kv.turbo_quant.codebook import codebook
from larql.kv.turbo_quant.codec import TurboQuantCodec
from larql.kv.turbo_quant.coded_cpu import codes_in_place
from larql.kv.turbo_quant.compiled_codec import encode_rows
from larql.kv.turbo_quant.rotation import rotation_matrix
from larql.models import Model
from tiny_models import random_ids


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "width", "centered"),
    [
        (1, 9, 3, 64, True),
        (37, 9, 3, 64, False),  # SmolLM2's heads: the 512-bit loop where AVX-512 runs
        (700, 9, 3, 64, True),  # chunks of rows over the threads
        (300, 4, 2, 128, True),
        (50, 8, 1, 64, False),  # a group of 8: the most the 512-bit loop takes
        (40, 6, 2, 32, True),  # another width: the buffered loop (AVX2's decoding) everywhere
        (0, 9, 3, 64, True),  # no coded rows yet: the exact rows alone
    ],
)
def test_coded_attention_is_the_softmax_over_the_decoded_and_exact_rows(
    cpu_kernels, rows: int, heads: int, kv_heads: int, width: int, centered: bool, bits: int
) -> None:
    g = torch.Generator().manual_seed(rows)
    codec = TurboQuantCodec(width, bits, norm_correction=True)
    size = codec.bytes_per_vector
    mean = torch.randn(2, kv_heads, width, generator=g) if centered else None
    k, v = (torch.randn(rows * kv_heads, width, generator=g) * 3 for _ in range(2))
    codes = torch.cat(
        (codec.encode(k).view(rows, kv_heads * size), codec.encode(v).view(rows, kv_heads * size)),
        dim=1,
    )  # [rows, K heads' vectors ; V heads']
    exact = [
        torch.randn(5, 2, kv_heads, width, generator=g).half(),
        torch.randn(1, 2, kv_heads, width, generator=g),
    ]
    q = torch.randn(heads, width, generator=g)
    scale = 0.125
    rotation = rotation_matrix(width, torch.float32, "cpu")
    no_mean = torch.empty(0) if mean is None else mean
    out = cpu_kernels.coded_attention(
        q, rotation, codes, kv_heads, codebook(width, bits).centroids, no_mean, exact, scale
    )
    group = heads // kv_heads
    halves = (codes[:, : kv_heads * size], codes[:, kv_heads * size :])
    keys, values = (
        codec.decode(half.reshape(-1, size), torch.float64).view(rows, kv_heads, width)
        if rows
        else torch.zeros(0, kv_heads, width, dtype=torch.float64)
        for half in halves
    )
    if mean is not None:
        keys, values = keys + mean[0].double(), values + mean[1].double()
    exact_rows = torch.cat([part.double() for part in exact])  # [E, 2, Hkv, D]
    keys = torch.cat((keys, exact_rows[:, 0])).transpose(0, 1).repeat_interleave(group, 0)
    values = torch.cat((values, exact_rows[:, 1])).transpose(0, 1).repeat_interleave(group, 0)
    weights = torch.softmax(scale * torch.einsum("hd,htd->ht", q.double(), keys), dim=-1)
    want = torch.einsum("ht,htd->hd", weights, values)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=2e-5)


def test_coded_attention_refuses_rows_of_another_shape(cpu_kernels) -> None:
    codes = torch.zeros(4, 100, dtype=torch.uint8)
    rotation, exact = torch.eye(64), [torch.zeros(1, 2, 3, 64)]
    with pytest.raises(RuntimeError, match="a key and a value vector per K/V head"):
        cpu_kernels.coded_attention(
            torch.zeros(9, 64), rotation, codes, 3, torch.zeros(16), torch.empty(0), exact, 1.0
        )
    with pytest.raises(RuntimeError, match=r"exact rows must be \[E, 2, Hkv, D\]"):
        no_codes = torch.zeros(0, 216, dtype=torch.uint8)
        cpu_kernels.coded_attention(
            torch.zeros(9, 64),
            rotation,
            no_codes,
            3,
            torch.zeros(16),
            torch.empty(0),
            [torch.zeros(1, 3, 64)],
            1.0,
        )


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize(("width", "dim"), [(64, 64), (128, 128), (64, 48)])
def test_compiled_encoding_is_the_codecs(cpu_kernels, width: int, dim: int, bits: int) -> None:
    """The extension's codes are the torch codec's bytes, but for a coordinate that float
    rounding puts on the other side of a cell boundary; the norms agree to rounding."""
    g = torch.Generator().manual_seed(width + dim)
    rows = torch.randn(400, 2, 3, dim, generator=g) * 2 + 0.5  # [S, 2, Hkv, D]
    rows[7] = 0.0  # a zero vector: index 8 (the cell at 0) everywhere, norm 0
    mean = rows.mean(0)
    codec = TurboQuantCodec(dim, bits, norm_correction=True)
    want = codec.encode((rows - mean).reshape(-1, dim)).view(400, -1)
    for x in (rows, rows.half().float()):
        got = encode_rows(codec, x.half() if x is not rows else x, mean)
        reference = want if x is rows else codec.encode((x - mean).reshape(-1, dim)).view(400, -1)
        assert got.shape == reference.shape and got.dtype == torch.uint8
        size = codec.bytes_per_vector
        got_v, want_v = got.view(-1, size), reference.view(-1, size)
        norms_got, norms_want = (
            got_v[:, :4].contiguous().view(torch.float32),
            want_v[:, :4].contiguous().view(torch.float32),
        )
        torch.testing.assert_close(norms_got, norms_want, rtol=2e-6, atol=0)
        indices_got = codec.decode_indices(got_v[:, 4:]).int()
        indices_want = codec.decode_indices(want_v[:, 4:]).int()
        differ = indices_got != indices_want
        assert differ.float().mean() < 1e-4  # a few boundary cases at most
        assert ((indices_got - indices_want).abs()[differ] == 1).all()


@pytest.fixture(scope="module")
def model(smollm2: Model) -> Model:
    """The real model's first two layers: its heads and codes, every layer's step alike."""
    return first_layers(smollm2, 2)


@pytest.fixture(scope="module")
def model_f64(model: Model) -> Model:
    return model.to(dtype=torch.float64)


SPECS = [
    "turbo-quant",
    "turbo-quant:center=0,sinks=0,recent=0",
    # long: the coded attention's own test above runs 2, 3 and 4 bits against the decoded rows
    pytest.param("turbo-quant:bits=3", marks=pytest.mark.long),
    pytest.param("turbo-quant:bits=2", marks=pytest.mark.long),
    # kv-quant's integer codes (`kv/kv_quant/compiled`): the same step through its own call
    "kv-quant",
    # long: the bits=2 rotated groups below step over the same kind of codes
    pytest.param("kv-quant:bits=8,group=64,rotate=1", marks=pytest.mark.long),
    "kv-quant:bits=2,group=64,rotate=1,recent=64,recent_bits=8,sinks=4",
    # its fp8 codes (attended in place, encoded by torch)
    "kv-quant:format=fp8",
    # long: plain fp8 above, and the rotated integer groups, cover its parts
    pytest.param("kv-quant:format=fp8,group=64,rotate=1", marks=pytest.mark.long),
]


@pytest.mark.parametrize("spec", SPECS)
def test_the_step_over_codes_is_the_step_over_the_decoded_history(
    cpu_kernels, spec: str, model: Model, monkeypatch
) -> None:
    """Every layer's attention output of three decode steps after a 200-token prompt, both
    ways on the same state: within float32 rounding of each other."""
    ids = context_ids(model, 200, default_text())
    gaps = _gaps_in_three_steps(parse_engine(spec).build(model), model, ids, monkeypatch)
    assert len(gaps) == 3 * model.config.num_layers
    assert max(gaps) < 2e-5


def _gaps_in_three_steps(engine, model: Model, ids: list[int], monkeypatch) -> list[float]:
    """Each layer's attention of three decode steps after `ids`, in place and over the decoded
    history on the same state: their gaps (relative to the decoded one's largest)."""
    in_place = engine._attend_in_place
    gaps: list[float] = []

    def both(model, layer, q, k, v, rotation, shared):
        got = in_place(model, layer, q, k, v, rotation, shared)
        assert got is not None, f"layer {layer} did not attend in place"
        keys, values = engine._history_with_row(model, layer, k, v, rotation)
        want = engine._attend_in_basis(model, layer, q, keys, values, rotation)
        gaps.append(((got - want).abs().max() / want.abs().max()).item())
        return want

    monkeypatch.setattr(engine, "_attend_in_place", both)
    session = GenerationSession(engine, model, DenseFfn(model), ids, 8, stop_ids=frozenset())
    session.prefill()
    for _ in range(3):
        session.step()
    return gaps


@pytest.mark.parametrize(
    "spec",
    [
        # long: kv-quant (the same engine class's batched step) checks the same, and
        # test_turbo_quant_coded_layers turbo-quant's batch against each session alone
        pytest.param("turbo-quant", marks=pytest.mark.long),
        "kv-quant",
    ],
)
def test_batched_steps_over_codes_equal_each_session_alone(
    cpu_kernels, spec: str, model: Model
) -> None:
    prompts = [context_ids(model, n, default_text()) for n in (40, 90)]
    ffn = DenseFfn(model)

    def sessions():
        made = [
            GenerationSession(
                parse_engine(spec).build(model), model, ffn, p, 8, stop_ids=frozenset()
            )
            for p in prompts
        ]
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


def test_the_torch_path_keeps_what_the_kernel_does_not_cover(
    model: Model, model_f64: Model
) -> None:
    ids = context_ids(model, 60, default_text())
    for m, spec in ((model, "turbo-quant:k_bits=4,v_bits=2"), (model_f64, "turbo-quant")):
        engine = parse_engine(spec).build(m)
        engine.prefill(m, DenseFfn(m), ids)
        rotation = engine._rotation(m.device, 0)
        shared = engine_module.SharedKv(m.config)
        assert not codes_in_place(m, 0, engine._layers[0], rotation, shared)


@pytest.mark.parametrize(
    ("module", "call", "torch_path", "in_place"),
    [
        # `attention=sdpa` is the torch reference: it decodes the rows where the kernel runs
        (engine_module, "attend_coded", "turbo-quant:attention=sdpa", "turbo-quant"),
        # groups of 3 pad a head of 64 to 66 coordinates: no whole bytes for 8 of them
        (kv_engine_module, "attend_grouped", "kv-quant:bits=8,group=3", "kv-quant:format=fp8"),
    ],
)
def test_what_keeps_the_path_that_decodes(
    model: Model, monkeypatch, module, call: str, torch_path: str, in_place: str
) -> None:
    calls: list[int] = []
    original = getattr(module, call)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, call, counted)
    ids = context_ids(model, 60, default_text())
    for spec, expected in ((torch_path, 0), (in_place, model.config.num_layers)):
        calls.clear()
        session = GenerationSession(
            parse_engine(spec).build(model),
            model,
            DenseFfn(model),
            ids,
            4,
            stop_ids=frozenset(),
        )
        session.prefill()
        session.step()
        assert len(calls) == expected


@pytest.mark.parametrize("spec", ["turbo-quant:recent=2", "kv-quant:recent=2,group=8"])
def test_sliding_layers_attend_their_windows_codes_in_place(
    cpu_kernels, spec: str, tiny_gemma3: Model, monkeypatch
) -> None:
    """tiny gemma3 in float32 (sliding layers of 6 keys beside global ones): a sliding layer's
    store holds just its window, so its step runs over the window's codes in place too, within
    float32 rounding of the path that decodes them, past the window (24 tokens, 3 steps)."""
    model = tiny_gemma3.to(dtype=torch.float32)
    engine = parse_engine(spec).build(model)
    gaps = _gaps_in_three_steps(engine, model, random_ids(24, seed=11), monkeypatch)
    assert len(gaps) == 3 * model.config.num_layers
    assert max(gaps) < 2e-5
    sliding = [i for i, spec in enumerate(model.config.layers) if spec.sliding_window]
    assert sliding and all(len(engine._layers[i].codes) > 0 for i in sliding)
