"""turbo-quant's Triton kernels (`larql.kernels.turbo_quant`) against the torch codec and a
float64 attention over the decoded rows, and the engine that uses them against its torch path.

On a CUDA machine the kernels run compiled; on a CPU machine with Triton installed, in Triton's
interpreter (tests/conftest.py turns it on); without Triton these tests skip."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from helpers import kernel_module, model_for_kernels, relative_error
from larql.inference.engine import AnyEngine
from larql.inference.ffn import DenseFfn
from larql.inference.generation import teacher_forced_logits
from larql.kv.turbo_quant import TurboQuantEngine
from larql.kv.turbo_quant.codec import TurboQuantCodec, split_norms
from larql.models import Model

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
PROMPT = "Alice put the red ball in the box, and Bob"


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return kernel_module("turbo_quant")


def draw(generator: torch.Generator, *size: int) -> torch.Tensor:
    return torch.randn(*size, generator=generator).to(DEVICE)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dim", [64, 48, 128])
def test_encode_writes_the_codec_bytes(kernels, bits: int, dim: int) -> None:
    """Same indices as `TurboQuantCodec.encode`; the float32 norm may differ in its last bit
    (the kernel sums the squares in another order)."""
    codec = TurboQuantCodec(dim, bits)
    x = draw(torch.Generator().manual_seed(bits * dim), 300, dim)
    expected = codec.encode(x)
    got = kernels.encode(x, kernels.CodecTables.of(codec, DEVICE))
    assert got.shape == expected.shape and got.dtype == torch.uint8
    (norms, payload), (ref_norms, ref_payload) = split_norms(got), split_norms(expected)
    assert torch.equal(codec.decode_indices(payload), codec.decode_indices(ref_payload))
    assert relative_error(norms, ref_norms) <= 3e-7


def reference_attention(q, k_new, v_new, stored, codec, scale: float, softcap: float):
    """float64 attention over the decoded stored rows followed by the exact new row."""
    kv_heads, _, dim = k_new.shape
    n = 0 if stored is None else stored.shape[0]
    keys, values = k_new.double(), v_new.double()
    if n:
        rows = codec.decode(stored.reshape(-1, codec.bytes_per_vector), torch.float64)
        rows = rows.view(n, 2, kv_heads, dim)
        keys = torch.cat((rows[:, 0].transpose(0, 1), keys), dim=1)  # [Hkv, n + 1, D]
        values = torch.cat((rows[:, 1].transpose(0, 1), values), dim=1)
    group = q.shape[0] // kv_heads
    scores = q.double() @ keys.repeat_interleave(group, 0).transpose(1, 2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.softmax(scores, -1) @ values.repeat_interleave(group, 0)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "bits", "n", "softcap"),
    [
        (9, 3, 64, 4, 70, 0.0),  # SmolLM2's heads
        (9, 3, 64, 2, 1, 0.0),  # one stored row
        (9, 3, 64, 3, 0, 0.0),  # none: the new row alone
        (4, 1, 48, 3, 600, 0.0),  # padded head width; two blocks per split
        (4, 2, 64, 4, 90, 30.0),  # soft-capped scores (Gemma 2)
    ],
)
def test_attention_equals_float64_over_the_decoded_rows(
    kernels, heads, kv_heads, dim, bits, n, softcap
) -> None:
    codec = TurboQuantCodec(dim, bits)
    generator = torch.Generator().manual_seed(n + dim + bits)
    q, k_new, v_new = (draw(generator, h, 1, dim) for h in (heads, kv_heads, kv_heads))
    stored = None
    if n:
        history = draw(generator, n * 2 * kv_heads, dim)  # [K heads, V heads] per token
        stored = codec.encode(history).view(n, -1)
    tables = kernels.CodecTables.of(codec, DEVICE)
    out = kernels.attention(q, k_new, v_new, stored, tables, dim**-0.5, softcap)
    expected = reference_attention(q, k_new, v_new, stored, codec, dim**-0.5, softcap)
    assert out.shape == (heads, 1, dim)
    assert relative_error(out, expected) <= 2e-6


def test_attention_reads_a_store_in_place(kernels) -> None:
    """The engine passes a slice of a larger buffer (GrowableRows): a row offset and stride."""
    codec = TurboQuantCodec(64, 4)
    generator = torch.Generator().manual_seed(7)
    buffer = codec.encode(draw(generator, 40 * 6, 64)).view(40, -1)
    stored = buffer[5:33]  # [28, row_bytes], a view at an offset
    q, k_new, v_new = (
        draw(generator, 9, 1, 64),
        draw(generator, 3, 1, 64),
        draw(generator, 3, 1, 64),
    )
    out = kernels.attention(q, k_new, v_new, stored, kernels.CodecTables.of(codec, DEVICE), 0.125)
    expected = reference_attention(q, k_new, v_new, stored, codec, 0.125, 0.0)
    assert relative_error(out, expected) <= 2e-6


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4])
def test_engine_with_the_kernels_equals_its_torch_path(
    kernels, bits: int, smollm2: Model, monkeypatch
) -> None:
    model = model_for_kernels(smollm2, monkeypatch)
    ffn = DenseFfn(model)
    ids = model.tokenizer.encode(PROMPT + " took it")
    fused = TurboQuantEngine(bits=bits)
    torch_path = TurboQuantEngine(bits=bits, attention="sdpa")
    ours = teacher_forced_logits(AnyEngine(fused), model, ffn, ids, 8)
    reference = teacher_forced_logits(AnyEngine(torch_path), model, ffn, ids, 8)
    assert "triton kernels" in fused.info().description
    assert "triton" not in torch_path.info().description
    assert relative_error(ours, reference) <= 1e-4
