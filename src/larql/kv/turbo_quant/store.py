"""One layer of turbo-quant's K/V on the torch path, in token order:

    [sinks: the first rows, exact] [codes: the rows between, quantised] [recent: the newest, exact]

A new row enters the sinks while there is room, else the recent rows; the oldest recent row
beyond `recent` is encoded into the codes (append-only: a stored code is never re-encoded), from
its stored copy (rows that never fit among the recent ones are encoded from the exact rows).
Sink rows are kept at 16 bits (the model's dtype where it is 16-bit, else float16), the recent
rows at `recent_bits`: 16 (exact, likewise) or 8 (int8 with a scale per head vector). With
`center`, the codes hold x − μ, μ the mean K (and V) row of the layer's prompt per K/V head:
q·(k − μ) differs from q·k by the same constant for every key, so only the quantisation error
changes; μ is added back when the codes are read. On a sliding layer a query sees only the
last `keep` rows: the layer keeps no sinks, at most `keep` recent rows, and the codes before
them up to `keep` in all, so the rows it holds are always the contiguous positions before the
next token's. A `compiled` layer (`compiled_codec.compiled_codes`) is encoded by the CPU extension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from larql.inference.memory import MemoryBreakdown, tensor_bytes
from larql.inference.snapshots import StateReader, StateWriter
from larql.kv.rows import GrowableRows
from larql.kv.turbo_quant.codec import RowCodec
from larql.kv.turbo_quant.compiled_codec import encode_rows
from larql.kv.turbo_quant.recent import RecentRows


@dataclass(frozen=True)
class KvLayout:
    """How a turbo-quant engine keeps each layer's K/V."""

    k_codec: RowCodec
    v_codec: RowCodec
    sinks: int = 0
    recent: int = 0
    center: bool = False
    recent_bits: int = 16  # 16: the recent rows exact; 8: int8 with a scale per head vector


def exact_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The 16-bit dtype exact rows are kept in."""
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.float16


class QuantisedLayer:
    def __init__(
        self,
        layout: KvLayout,
        keep: int | None,
        kv_heads: int,
        dtype: torch.dtype,
        compiled: bool = False,
    ) -> None:
        self.layout = layout
        self.kv_heads = kv_heads
        self.compiled = compiled  # encoded (and attended) by the CPU extension
        self.exact = exact_dtype(dtype)
        self.sinks = GrowableRows()  # [n, 2, Hkv, D] exact
        self.sink_room = layout.sinks if keep is None else 0
        self.recent_room = layout.recent if keep is None else min(layout.recent, keep)
        self.recent = RecentRows(layout.recent_bits, self.exact)  # [n, 2, Hkv, D]
        self.codes = GrowableRows(None if keep is None else keep - self.recent_room)
        self.mean: torch.Tensor | None = None  # [2, Hkv, D] float32, with `center`

    def __len__(self) -> int:
        return len(self.sinks) + len(self.codes) + len(self.recent)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's code row: its K heads' vectors, then its V heads'."""
        k, v = self.layout.k_codec, self.layout.v_codec
        return self.kv_heads * (k.bytes_per_vector + v.bytes_per_vector)

    def memory(self) -> MemoryBreakdown:
        stores = [self.sinks, self.codes, *self.recent.storages()]
        return MemoryBreakdown.of(hot=stores) + MemoryBreakdown(hot=tensor_bytes(self.mean))

    # ------------------------------------------------------------------ saved state

    def write_state(self, state: StateWriter) -> None:
        """`sinks` [n, 2, Hkv, D], `codes` [n, row_bytes] uint8, the recent rows (`recent.*`)
        and, with `center`, the prompt's `mean` [2, Hkv, D] float32."""
        state.tensor("sinks", self.sinks.live_rows())
        state.tensor("codes", self.codes.live_rows())
        self.recent.write_state(state.scope("recent"))
        state.tensor("mean", self.mean)

    def read_state(self, state: StateReader, tokens: int) -> None:
        """Take back the rows of `tokens` tokens into this empty layer: the first into the
        sinks, the newest (up to `recent` of them: fewer in a state cut back to a prefix,
        `cut_back`) exact, the rest as codes (on a sliding layer, only the rows a query can
        still see)."""
        sinks = min(tokens, self.sink_room)
        most_recent = min(tokens - sinks, self.recent_room)
        recent = state.scope("recent").row_count("codes", 0, most_recent)
        codes = tokens - sinks - recent
        if self.codes.keep is not None:
            codes = min(codes, self.codes.keep)
        heads, dim = self.kv_heads, self.layout.k_codec.dim
        self.sinks = GrowableRows.holding(state.rows("sinks", self.exact, sinks, (2, heads, dim)))
        stored = state.rows("codes", torch.uint8, codes, (self.row_bytes,))
        self.codes = GrowableRows.holding(stored, self.codes.keep)
        self.recent.read_state(state.scope("recent"), recent, (2, heads, dim))
        if self.layout.center and tokens:
            self.mean = state.tensor("mean", torch.float32, (2, heads, dim))

    def cut_back(self, tokens: int) -> bool:
        """Keep only the rows of the first `tokens` tokens (sinks, then codes, then recent rows,
        in token order) → whether it could: a sliding layer no longer holds the older rows.
        The rows that stay keep their form: a row already coded stays coded."""
        if self.codes.keep is not None or tokens > len(self):
            return False
        sinks = min(tokens, len(self.sinks))
        codes = min(tokens - sinks, len(self.codes))
        self.sinks.truncate(sinks)
        self.codes.truncate(codes)
        self.recent.truncate(tokens - sinks - codes)
        return True

    def uncode_newest(self) -> None:
        """After `cut_back`: the newest coded rows back among the recent rows, decoded (the
        values the codes hold), until the recent rows are as many as a layer of this length
        holds when its rows came one after another — the layout a path keeping the newest
        rows in a ring needs (`KernelPath.take_layer`)."""
        held = min(self.recent_room, len(self) - len(self.sinks))
        n = min(held - len(self.recent), len(self.codes))
        if n <= 0:
            return
        keys, values = self._decoded(torch.float32, None, self.codes.rows[-n:])  # [Hkv, n, D]
        newer = [store.live_rows() for store in self.recent.storages()]
        newer = [None if rows is None else rows.clone() for rows in newer]
        self.codes.truncate(len(self.codes) - n)
        self.recent.truncate(0)
        self.recent.append(torch.stack((keys, values)).permute(2, 0, 1, 3))  # [n, 2, Hkv, D]
        for store, rows in zip(self.recent.storages(), newer, strict=True):
            if rows is not None and rows.shape[0]:
                store.append(rows)  # in their stored form

    # ------------------------------------------------------------------ writing

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [Hkv, S, D] exact new rows, in token order."""
        rows = torch.stack((k, v)).permute(2, 0, 1, 3)  # [S, 2, Hkv, D]
        if self.layout.center and self.mean is None:
            self.mean = rows.float().mean(dim=0)  # [2, Hkv, D] over the prompt
        into_sinks = min(self.sink_room - len(self.sinks), rows.shape[0])
        if into_sinks > 0:
            self.sinks.append(rows[:into_sinks].to(self.exact))
            rows = rows[into_sinks:]
        overflow = len(self.recent) + rows.shape[0] - self.recent_room  # rows leaving exactness
        from_recent = min(max(overflow, 0), len(self.recent))
        if from_recent:
            self._encode(self.recent.pop_front(from_recent))
        direct = max(overflow - from_recent, 0)  # new rows that never fit: encoded as they are
        if direct:
            self._encode(rows[:direct])
        if direct < rows.shape[0]:
            self.recent.append(rows[direct:])

    def _encode(self, rows: torch.Tensor) -> None:
        """rows: [S, 2, Hkv, D] → one code row per token, [K heads ; V heads], appended."""
        self.codes.append(self.coded(rows))
        self.codes.clip()

    def coded(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [S, 2, Hkv, D] → their code rows [S, row_bytes] uint8, as `append` codes them."""
        s = rows.shape[0]
        if self.compiled:
            return encode_rows(self.layout.k_codec, rows, self.mean)  # type: ignore[arg-type]
        x = rows.to(torch.promote_types(rows.dtype, torch.float32))  # float64 stays float64
        if self.mean is not None:
            x = x - self.mean
        if self.layout.k_codec is self.layout.v_codec:  # K then V heads, one call: [S, row_bytes]
            coded = self.layout.k_codec.encode(x.reshape(s * 2 * self.kv_heads, -1)).view(s, -1)
        else:
            k = self.layout.k_codec.encode(x[:, 0].reshape(s * self.kv_heads, -1))
            v = self.layout.v_codec.encode(x[:, 1].reshape(s * self.kv_heads, -1))
            coded = torch.cat((k.view(s, -1), v.view(s, -1)), dim=1)
        return coded

    # ------------------------------------------------------------------ reading

    def keys_values(
        self, dtype: torch.dtype, rotation: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored row, oldest first → keys, values [Hkv, n, D] in `dtype`; with
        `rotation` R [D', D'] (float32), in the codec's rotated basis: [Hkv, n, D']."""
        parts = []
        if len(self.sinks):
            parts.append(self._exact(self.sinks.rows, dtype, rotation))
        if len(self.codes):
            parts.append(self._decoded(dtype, rotation))
        if len(self.recent):
            parts.append(self._exact(self.recent.rows, dtype, rotation))
        if not parts:
            width = self.layout.k_codec.dim if rotation is None else rotation.shape[0]
            empty = torch.zeros((self.kv_heads, 0, width), dtype=dtype, device=self._device())
            return empty, empty
        keys = torch.cat([p[0] for p in parts], dim=1)
        values = torch.cat([p[1] for p in parts], dim=1)
        return keys, values

    def exact_keys_values(
        self, dtype: torch.dtype, rotation: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact rows alone (the sinks, then the recent rows) → keys, values [Hkv, E, D']
        as `keys_values` gives them."""
        parts = [
            self._exact(store.rows, dtype, rotation)
            for store in (self.sinks, self.recent)
            if len(store)
        ]
        if not parts:
            width = self.layout.k_codec.dim if rotation is None else rotation.shape[0]
            empty = torch.zeros((self.kv_heads, 0, width), dtype=dtype, device=self._device())
            return empty, empty
        if len(parts) == 1:
            return parts[0]
        return torch.cat((parts[0][0], parts[1][0]), 1), torch.cat((parts[0][1], parts[1][1]), 1)

    def _exact(
        self, rows: torch.Tensor, dtype: torch.dtype, rotation: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = rows.permute(1, 2, 0, 3)  # [2, Hkv, n, D]
        if rotation is not None:
            x = rotate(x, rotation)
        return x[0].to(dtype), x[1].to(dtype)

    def _decoded(
        self, dtype: torch.dtype, rotation: torch.Tensor | None, codes: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The code rows (every one, or `codes` [n, row_bytes]: K heads' vectors, then V
        heads') decoded → keys, values [Hkv, n, D], or [Hkv, n, D'] in the rotated basis."""
        codes = self.codes.rows if codes is None else codes
        n = codes.shape[0]
        k_codec, v_codec = self.layout.k_codec, self.layout.v_codec
        if k_codec is v_codec:  # both halves in one call
            x = self._decode(k_codec, codes.reshape(n * 2 * self.kv_heads, -1), dtype, rotation)
            x = x.view(n, 2, self.kv_heads, -1).permute(1, 2, 0, 3)  # [2, Hkv, n, D or D']
            halves = [x[0], x[1]]
        else:
            k_bytes = self.kv_heads * k_codec.bytes_per_vector
            halves = [
                self._decode(codec, data.reshape(n * self.kv_heads, -1), dtype, rotation)
                .view(n, self.kv_heads, -1)
                .transpose(0, 1)  # [Hkv, n, D or D']
                for codec, data in ((k_codec, codes[:, :k_bytes]), (v_codec, codes[:, k_bytes:]))
            ]
        if self.mean is not None:
            mean = self.mean.unsqueeze(2)  # [2, Hkv, 1, D]
            shift = rotate(mean, rotation) if rotation is not None else mean
            halves = [halves[0] + shift[0], halves[1] + shift[1]]
        return halves[0].to(dtype), halves[1].to(dtype)

    @staticmethod
    def _decode(
        codec: RowCodec, vectors: torch.Tensor, dtype: torch.dtype, rotation: torch.Tensor | None
    ) -> torch.Tensor:
        """uint8 [N, bytes_per_vector] → [N, D] decoded, or [N, D'] still rotated (float32)."""
        if rotation is not None:
            return codec.decode_rotated(vectors, torch.float32)  # type: ignore[attr-defined]
        return codec.decode(vectors, torch.promote_types(dtype, torch.float32))

    def _device(self) -> torch.device:
        for store in (self.codes, self.recent, self.sinks):
            if len(store):
                return store.rows.device
        return torch.device("cpu")


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """[..., D] → [..., D'], zero-padded to the rotation's width and rotated, in float32."""
    padding = rotation.shape[0] - x.shape[-1]
    return torch.nn.functional.pad(x.float(), (0, padding)) @ rotation
