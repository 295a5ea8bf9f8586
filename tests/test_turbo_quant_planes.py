"""The kernel path's store laid out by plane: each head's codes token by token, then the norms."""

from __future__ import annotations

import pytest
import torch

from larql.kv.turbo_quant import planes
from larql.kv.turbo_quant.codec import NORM_BYTES, TurboQuantCodec


def encoded_rows(codec: TurboQuantCodec, tokens: int, kv_heads: int, seed: int) -> torch.Tensor:
    """`tokens` rows of 2·Hkv encoded vectors, the codec's row format: uint8 [tokens, row_bytes]."""
    generator = torch.Generator().manual_seed(seed)
    vectors = torch.randn(tokens * 2 * kv_heads, codec.dim, generator=generator)
    return codec.encode(vectors).view(tokens, -1)


@pytest.mark.parametrize(("dim", "bits", "kv_heads"), [(64, 4, 8), (64, 3, 3), (48, 2, 1)])
def test_a_vector_lands_where_the_kernels_read_it(dim: int, bits: int, kv_heads: int) -> None:
    """Slot s of plane p: its packed indices at byte (p·slots + s)·payload, its norm at float32
    2·Hkv·slots·payload / 4 + p·slots + s."""
    codec = TurboQuantCodec(dim, bits)
    bpv, slots = codec.bytes_per_vector, 6
    rows = encoded_rows(codec, slots, kv_heads, seed=bits)
    store = planes.from_rows(rows, bpv)
    flat = store.view(-1)
    payload = bpv - NORM_BYTES
    norms_at = 2 * kv_heads * slots * payload // 4
    for s in range(slots):
        for p in range(2 * kv_heads):
            vector = rows[s, p * bpv : (p + 1) * bpv]
            at = (p * slots + s) * payload
            assert torch.equal(flat[at : at + payload], vector[NORM_BYTES:])
            norm = flat.view(torch.float32)[norms_at + p * slots + s]
            assert norm.item() == vector[:NORM_BYTES].view(torch.float32).item()


def test_rows_written_into_slots_read_back_as_written() -> None:
    """Rows scattered into a ring's slots come back in the codec's row format; slots not
    written keep their bytes."""
    codec = TurboQuantCodec(64, 4)
    bpv, kv_heads = codec.bytes_per_vector, 3
    store = planes.from_rows(encoded_rows(codec, 8, kv_heads, seed=1), bpv)
    before = planes.to_rows(store, bpv)
    rows = encoded_rows(codec, 3, kv_heads, seed=2)
    slots = torch.tensor([6, 0, 3])
    planes.write_rows(store, slots, rows, bpv)
    assert torch.equal(planes.read_rows(store, slots, bpv), rows)
    after = planes.to_rows(store, bpv)
    untouched = [1, 2, 4, 5, 7]
    assert torch.equal(after[untouched], before[untouched])


def test_the_codes_and_norms_are_views_of_the_store() -> None:
    codec = TurboQuantCodec(64, 4)
    bpv = codec.bytes_per_vector
    store = torch.zeros((5, 2 * 2 * bpv), dtype=torch.uint8)
    planes.norm_planes(store, bpv)[3, 4] = 2.5
    planes.code_planes(store, bpv)[1, 2, 0] = 7
    rows = planes.to_rows(store, bpv)
    assert rows[4, 3 * bpv : 3 * bpv + NORM_BYTES].view(torch.float32).item() == 2.5
    assert rows[2, bpv + NORM_BYTES].item() == 7
    assert planes.code_planes(store, bpv).shape == (4, 5, bpv - NORM_BYTES)
    assert planes.norm_planes(store, bpv).shape == (4, 5)
