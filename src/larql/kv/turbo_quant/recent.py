"""The newest rows of a quantising layer, before they are coded: exact at 16 bits, or int8.

At 8 bits each head vector is stored as int8 codes with one float16 scale (its largest magnitude
/ 127, symmetric, round to nearest): D + 2 bytes instead of 2·D. Twice as many newest rows fit in
the same bytes, and int8 keeps every coordinate within 0.4% of the vector's largest one — far
closer to exact than the low-bit codes the rows later become. When a row leaves the newest
ones it is coded from its int8 copy.
"""

from __future__ import annotations

import torch

from larql.inference.snapshots import StateReader, StateWriter
from larql.kv.rows import GrowableRows

SUPPORTED_RECENT_BITS = (8, 16)
_INT8_MAX = 127


def int8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] float → (codes int8 [..., D], scales float16 [..., 1]); x ≈ codes · scales."""
    wide = x.float()
    scales = (wide.abs().amax(dim=-1, keepdim=True) / _INT8_MAX).to(torch.float16)  # [..., 1]
    divisor = torch.where(scales > 0, scales.float(), 1.0)
    codes = torch.round(wide / divisor).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return codes, scales


def int8_decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes int8 [..., D], scales float16 [..., 1] → float32 [..., D]."""
    return codes.float() * scales.float()


class RecentRows:
    """Rows [n, 2, Hkv, D] in token order, held at `bits` (16: in `exact_dtype`; 8: int8 + a
    float16 scale per head vector). Reads give float rows back (int8 ones decoded)."""

    def __init__(self, bits: int, exact_dtype: torch.dtype) -> None:
        if bits not in SUPPORTED_RECENT_BITS:
            raise ValueError(f"recent rows are kept at 8 or 16 bits, got {bits}")
        self.bits = bits
        self.exact_dtype = exact_dtype
        self.codes = GrowableRows()  # [n, 2, Hkv, D] exact_dtype (16) or int8 (8)
        self.scales = GrowableRows()  # [n, 2, Hkv, 1] float16 (8 bits only)

    def __len__(self) -> int:
        return len(self.codes)

    def storages(self) -> list[GrowableRows]:
        return [self.codes, self.scales]

    def write_state(self, state: StateWriter) -> None:
        """`codes` [n, 2, Hkv, D] (exact, or int8) and at 8 bits `scales` [n, 2, Hkv, 1]."""
        state.tensor("codes", self.codes.live_rows())
        state.tensor("scales", self.scales.live_rows())

    def read_state(self, state: StateReader, count: int, row_shape: tuple[int, ...]) -> None:
        """Take back `count` rows of `row_shape` [2, Hkv, D]."""
        if self.bits == 16:
            self.codes = GrowableRows.holding(
                state.rows("codes", self.exact_dtype, count, row_shape)
            )
            return
        self.codes = GrowableRows.holding(state.rows("codes", torch.int8, count, row_shape))
        scales = state.rows("scales", torch.float16, count, (*row_shape[:-1], 1))
        self.scales = GrowableRows.holding(scales)

    @property
    def rows(self) -> torch.Tensor:
        """[n, 2, Hkv, D]: exact_dtype at 16 bits, float32 (decoded) at 8."""
        if self.bits == 16:
            return self.codes.rows
        return int8_decode(self.codes.rows, self.scales.rows)

    def append(self, rows: torch.Tensor) -> None:
        """rows: [S, 2, Hkv, D] float."""
        if self.bits == 16:
            self.codes.append(rows.to(self.exact_dtype))
            return
        codes, scales = int8_encode(rows)
        self.codes.append(codes)
        self.scales.append(scales)

    def truncate(self, n: int) -> None:
        """Keep the n oldest rows."""
        self.codes.truncate(n)
        self.scales.truncate(n)

    def keep_rows(self, index: torch.Tensor) -> None:
        """index [m, Hkv]: row index[j, h] of head h becomes its row j (each head its own rows,
        in order; the stored form kept, int8 codes and scales alike)."""
        for store in self.storages():
            if len(store):
                refill(store, gather_per_head(store.rows, index))

    def pop_front(self, n: int) -> torch.Tensor:
        """Remove the n oldest rows → [n, 2, Hkv, D] as `rows` gives them."""
        codes = self.codes.pop_front(n)
        if self.bits == 16:
            return codes
        return int8_decode(codes, self.scales.pop_front(n))


def gather_per_head(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [n, 2, Hkv, D], index [m, Hkv] → [m, 2, Hkv, D]: head h's row j is its row
    index[j, h] (its K and V alike)."""
    m, heads = index.shape
    picked = index[:, None, :, None].expand(m, rows.shape[1], heads, rows.shape[-1])
    return torch.gather(rows, 0, picked)


def refill(store: GrowableRows, rows: torch.Tensor) -> None:
    """Replace the store's live rows by rows [m, *row_shape] (a new tensor, not a view of
    them), in its own storage where they fit."""
    store.truncate(0)
    if rows.shape[0]:
        store.append(rows)
