"""The kernel path's store layout: one layer's coded tokens laid out by plane.

The codec writes a token as a row of 2·Hkv vectors (K heads, then V heads; `layout`), each a
header then the packed indices: turbo-quant's header is the float32 norm
(`TurboQuantCodec.encode`), kv-quant's the float16 scales and zero points of its groups
(`IntCodec.encode`). A store of `slots` tokens holds the same bytes, uint8 [slots, row_bytes],
ordered by plane instead of by token:

    codes    [2·Hkv, slots, payload]   plane p = K head p (p < Hkv), else V head p − Hkv
    headers  [2·Hkv, slots, header]    after every plane's codes

So one head's consecutive tokens are contiguous: a GPU warp reading 32 of them touches eight
128-byte lines of codes and one of norms, where the row format puts each token's vector a row
(576 bytes at the 1B shape) from the next. The kernels find slot s of plane p at byte
(p·slots + s)·payload, its header at byte 2·Hkv·payload·slots + (p·slots + s)·header.
`header` defaults to turbo-quant's (`NORM_BYTES`).
"""

from __future__ import annotations

import torch

from larql.kv.turbo_quant.codec import NORM_BYTES


def code_planes(
    store: torch.Tensor, bytes_per_vector: int, header: int = NORM_BYTES
) -> torch.Tensor:
    """store: uint8 [slots, row_bytes], contiguous → its codes, a view [2·Hkv, slots, payload]."""
    slots, row_bytes = store.shape
    planes, payload = row_bytes // bytes_per_vector, bytes_per_vector - header
    return store.view(-1)[: planes * slots * payload].view(planes, slots, payload)


def header_planes(
    store: torch.Tensor, bytes_per_vector: int, header: int = NORM_BYTES
) -> torch.Tensor:
    """store: uint8 [slots, row_bytes], contiguous → its headers, a view [2·Hkv, slots, header]."""
    slots, row_bytes = store.shape
    planes, payload = row_bytes // bytes_per_vector, bytes_per_vector - header
    return store.view(-1)[planes * slots * payload :].view(planes, slots, header)


def norm_planes(store: torch.Tensor, bytes_per_vector: int) -> torch.Tensor:
    """store: uint8 [slots, row_bytes] of turbo-quant codes, contiguous → its norms, a float32
    view [2·Hkv, slots]."""
    return header_planes(store, bytes_per_vector).view(torch.float32).squeeze(-1)


def write_rows(
    store: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    bytes_per_vector: int,
    header: int = NORM_BYTES,
) -> None:
    """rows: uint8 [n, row_bytes] in the codec's row format → into `store`'s slots [n] (int64)."""
    n, row_bytes = rows.shape
    vectors = rows.view(n, row_bytes // bytes_per_vector, bytes_per_vector)  # [n, 2·Hkv, BPV]
    codes = vectors[:, :, header:].transpose(0, 1)  # [2·Hkv, n, payload]
    headers = vectors[:, :, :header].transpose(0, 1)  # [2·Hkv, n, header]
    code_planes(store, bytes_per_vector, header).index_copy_(1, slots, codes.contiguous())
    header_planes(store, bytes_per_vector, header).index_copy_(1, slots, headers.contiguous())


def read_rows(
    store: torch.Tensor, slots: torch.Tensor, bytes_per_vector: int, header: int = NORM_BYTES
) -> torch.Tensor:
    """The tokens in `store`'s slots [n] (int64) in the codec's row format: uint8 [n, row_bytes]."""
    codes = code_planes(store, bytes_per_vector, header).index_select(1, slots)
    headers = header_planes(store, bytes_per_vector, header).index_select(1, slots)
    vectors = torch.cat((headers, codes), dim=2).transpose(0, 1)  # [n, 2·Hkv, BPV]
    return vectors.reshape(slots.shape[0], store.shape[1])


def from_rows(rows: torch.Tensor, bytes_per_vector: int, header: int = NORM_BYTES) -> torch.Tensor:
    """A store holding rows [slots, row_bytes] (row format), token t in slot t."""
    store = torch.empty_like(rows)
    slots = torch.arange(rows.shape[0], device=rows.device)
    write_rows(store, slots, rows, bytes_per_vector, header)
    return store


def to_rows(store: torch.Tensor, bytes_per_vector: int, header: int = NORM_BYTES) -> torch.Tensor:
    """Every slot of `store` in the row format: uint8 [slots, row_bytes]."""
    slots = torch.arange(store.shape[0], device=store.device)
    return read_rows(store, slots, bytes_per_vector, header)
