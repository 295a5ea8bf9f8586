"""kv-quant's CPU attention over its integer or fp8 codes in place (`kv/kv_quant/compiled`): the
extension's attention against a float64 softmax over the codec's decoded rows and the exact rows,
and which codes take it (the engine's step against the torch path, and batched against alone,
are in test_turbo_quant_coded_cpu.py with turbo-quant's)."""

from __future__ import annotations

import pytest
import torch

from larql.kv.kv_quant.codecs import Fp8Codec, IntCodec
from larql.kv.turbo_quant.packing import unpack_indices
from larql.kv.turbo_quant.rotation import rotation_matrix


@pytest.mark.parametrize("bits", [2, 4, 8, "fp8"])
@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "dim", "group", "rotate"),
    [
        (37, 9, 3, 64, 32, False),  # SmolLM2's heads, the catalog's groups
        (700, 9, 3, 64, 64, True),  # chunks of rows over the threads; rotated rows
        (50, 4, 2, 48, 16, True),  # a head the rotation pads (48 → 64)
        (40, 6, 2, 40, 8, False),  # groups of 8: the buffered loop (AVX2's decoding)
        (0, 9, 3, 64, 32, False),  # no coded rows yet: the exact rows alone
    ],
)
def test_grouped_attention_is_the_softmax_over_the_decoded_and_exact_rows(
    cpu_kernels, rows: int, heads: int, kv_heads: int, dim: int, group: int, rotate: bool, bits
) -> None:
    fp8 = bits == "fp8"
    g = torch.Generator().manual_seed(rows + (9 if fp8 else bits))
    codec = Fp8Codec(dim, group, rotate) if fp8 else IntCodec(dim, bits, group, rotate)
    size = codec.bytes_per_vector
    k, v = (torch.randn(rows * kv_heads, dim, generator=g) * 3 for _ in range(2))
    halves = [
        codec.encode(x).view(rows, kv_heads * size)
        if rows
        else torch.zeros(0, kv_heads * size, dtype=torch.uint8)
        for x in (k, v)
    ]
    codes = torch.cat(halves, dim=1)  # [rows, K heads' vectors ; V heads']
    exact = [
        torch.randn(5, 2, kv_heads, dim, generator=g).half(),
        torch.randn(1, 2, kv_heads, dim, generator=g),
    ]
    q = torch.randn(heads, dim, generator=g)
    scale = 0.125
    rotation = rotation_matrix(codec.coded_dim, torch.float32, "cpu") if rotate else torch.empty(0)
    out = cpu_kernels.grouped_attention(
        q, rotation, codes, kv_heads, codec.bits, fp8, codec.group, codec.padded_dim, exact, scale
    )
    group_heads = heads // kv_heads
    halves = (codes[:, : kv_heads * size], codes[:, kv_heads * size :])
    keys, values = (
        codec.decode(half.reshape(-1, size), torch.float64).view(rows, kv_heads, dim)
        if rows
        else torch.zeros(0, kv_heads, dim, dtype=torch.float64)
        for half in halves
    )
    exact_rows = torch.cat([part.double() for part in exact])  # [E, 2, Hkv, D]
    keys = torch.cat((keys, exact_rows[:, 0])).transpose(0, 1).repeat_interleave(group_heads, 0)
    values = torch.cat((values, exact_rows[:, 1])).transpose(0, 1)
    values = values.repeat_interleave(group_heads, 0)
    weights = torch.softmax(scale * torch.einsum("hd,htd->ht", q.double(), keys), dim=-1)
    want = torch.einsum("ht,htd->hd", weights, values)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=2e-5)


def test_grouped_attention_refuses_codes_of_another_shape(cpu_kernels) -> None:
    exact = [torch.zeros(1, 2, 3, 64)]
    codes = torch.zeros(4, 100, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="a key and a value vector per K/V head"):
        cpu_kernels.grouped_attention(
            torch.zeros(9, 64), torch.empty(0), codes, 3, 4, False, 32, 64, exact, 1.0
        )
    with pytest.raises(RuntimeError, match="bits must be 2, 4 or 8"):
        cpu_kernels.grouped_attention(
            torch.zeros(9, 64), torch.empty(0), codes, 3, 3, False, 32, 64, exact, 1.0
        )
    with pytest.raises(RuntimeError, match="fp8 codes are 8 bits"):
        cpu_kernels.grouped_attention(
            torch.zeros(9, 64), torch.empty(0), codes, 3, 4, True, 32, 64, exact, 1.0
        )


def _both_encodings(
    kernels, codec: IntCodec | Fp8Codec, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [S, 2, Hkv, D] → (the extension's codes, the torch codec's), [S · 2 · Hkv, bytes]."""
    got = codec.compiled_encode(kernels, rows, None).view(-1, codec.bytes_per_vector)
    want = codec.encode(rows.float().reshape(-1, rows.shape[-1]))
    assert got.shape == want.shape and got.dtype == torch.uint8
    return got, want


@pytest.mark.parametrize(
    ("dim", "group", "rotate"), [(64, 32, False), (40, 8, False), (64, 64, True), (48, 16, True)]
)
def test_compiled_fp8_encoding_is_the_codecs(
    cpu_kernels, dim: int, group: int, rotate: bool
) -> None:
    """e4m3 codes: the extension converts with torch's own e4m3 rounding (to nearest even,
    finite overflow saturating), so without a rotation it writes the torch codec's bytes, over
    magnitudes from 1e-12 to 1e6, a zero vector (its scales clamp to the smallest), a lone huge
    coordinate (its group's scale overflows float16 in both) and subnormal floats; with one, a
    scale or code within rounding may differ."""
    g = torch.Generator().manual_seed(dim + group)
    scales = torch.logspace(-12, 6, 300).view(-1, 1, 1, 1)
    rows = torch.randn(300, 2, 3, dim, generator=g) * scales  # [S, 2, Hkv, D]
    rows[0] = 0.0
    rows[1, 0, 0, 5] = 1e30
    rows[2] = 1e-39
    codec = Fp8Codec(dim, group, rotate)
    for x in (rows, rows.clamp(-6e4, 6e4).half()):
        got, want = _both_encodings(cpu_kernels, codec, x)
        if not rotate:
            assert torch.equal(got, want)
            continue
        decoded = [codec.decode(t, torch.float32) for t in (got, want)]
        torch.testing.assert_close(decoded[0], decoded[1], rtol=0.07, atol=1e-30, equal_nan=True)
        assert (got != want).float().mean() < 1e-2


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(
    ("dim", "group", "rotate"), [(64, 32, False), (64, 64, True), (48, 16, True), (40, 8, False)]
)
def test_compiled_encoding_is_the_codecs(
    cpu_kernels, dim: int, group: int, rotate: bool, bits: int
) -> None:
    """Without a rotation the extension writes the torch codec's bytes; with one, its sums run
    in another order, so a scale may differ in its last float16 bit and a coordinate within
    rounding of a step may take the neighbouring index."""
    g = torch.Generator().manual_seed(dim + group + bits)
    rows = torch.randn(300, 2, 3, dim, generator=g) * 2 + 0.5  # [S, 2, Hkv, D]
    rows[5] = 0.0  # a constant vector: its scales clamp to the smallest
    codec = IntCodec(dim, bits, group, rotate)
    for x in (rows, rows.half()):
        got, want = _both_encodings(cpu_kernels, codec, x)
        if not rotate:
            assert torch.equal(got, want)
            continue
        header = 4 * codec.groups
        scales_got = got[:, :header].contiguous().view(torch.float16).float()
        scales_want = want[:, :header].contiguous().view(torch.float16).float()
        torch.testing.assert_close(scales_got, scales_want, rtol=1e-3, atol=1e-7)
        indices = [unpack_indices(t[:, header:], codec.padded_dim, bits).int() for t in (got, want)]
        differ = indices[0] != indices[1]
        assert differ.float().mean() < 1e-3
        assert ((indices[0] - indices[1]).abs()[differ] == 1).all()
