"""`SinkKvBuffer`: one layer's K/V for `standard:window=N,sinks=S` (StreamingLLM): the first S
rows kept for good beside the sliding window's last N − 1.

Keys keep the RoPE rotation of their original positions (they are stored rotated, as in the
plain cache): a query at position i sees the sink rows at positions 0..S−1 and the window rows
at i − N + 1..i, at their true distances. (StreamingLLM's paper re-numbers the kept rows
contiguously instead; with original positions a query never sees a distance it was not trained
on either, since every distance it sees is < N or is to a sink.)
"""

from __future__ import annotations

import torch

from larql.inference.snapshots import StateReader, StateWriter
from larql.kv.buffers import KvBuffer


class SinkKvBuffer:
    def __init__(self, sinks: int, window: int) -> None:
        self.sinks, self.window = sinks, window
        self._sink = KvBuffer()  # positions 0 .. sinks − 1
        self._recent = KvBuffer(keep=window - 1)  # the latest positions ≥ sinks
        self._count = 0  # positions appended so far

    def __len__(self) -> int:
        return len(self._sink) + len(self._recent)

    def _joined(self, sink: torch.Tensor | None, recent: torch.Tensor) -> torch.Tensor:
        return recent if sink is None else torch.cat((sink, recent), dim=1)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [Hkv, S, D] at the next S positions → every live row, sinks first, then the
        window's rows oldest first: [Hkv, n, D]."""
        first_sinks = max(0, min(self.sinks - self._count, k.shape[1]))
        if first_sinks:
            self._sink.append(k[:, :first_sinks], v[:, :first_sinks])
        if k.shape[1] > first_sinks:
            self._recent.append(k[:, first_sinks:], v[:, first_sinks:])
        self._count += k.shape[1]
        return self.keys, self.values

    @property
    def keys(self) -> torch.Tensor:
        sink = self._sink.keys if len(self._sink) else None
        return self._joined(sink, self._recent.keys) if len(self._recent) else self._sink.keys

    @property
    def values(self) -> torch.Tensor:
        sink = self._sink.values if len(self._sink) else None
        return self._joined(sink, self._recent.values) if len(self._recent) else self._sink.values

    def positions(self) -> torch.Tensor:
        """The live rows' positions, in the order `keys` holds them: [n] int64."""
        recent = torch.arange(self._count - len(self._recent), self._count)
        return torch.cat((torch.arange(len(self._sink)), recent))

    def allowed(self, start: int, count: int) -> torch.Tensor | None:
        """Which live rows each of the queries at start..start+count−1 sees: [count, n] bool
        (None for one query: it sees every live row)."""
        if count == 1:
            return None
        # made where it is used: no [count, n] copy to the device (nor, on the meta device of
        # `larql memory`, a mask computed on the CPU for a structure that holds no values)
        device = self._recent.keys.device if len(self._recent) else torch.device("cpu")
        keys = self.positions().to(device).unsqueeze(0)  # [1, n]
        queries = torch.arange(start, start + count, device=device).unsqueeze(1)  # [count, 1]
        return (keys <= queries) & (((queries - keys) < self.window) | (keys < self.sinks))

    def clip(self) -> None:
        self._recent.clip()

    def nbytes(self) -> int:
        return self._sink.nbytes() + self._recent.nbytes()

    def write_state(self, state: StateWriter) -> None:
        self._sink.write_state(state.scope("sink"))
        self._recent.write_state(state.scope("recent"))

    def read_state(
        self, state: StateReader, count: int, dtype: torch.dtype, heads: int, dim: int
    ) -> None:
        """The rows of `count` positions: the first `sinks` of them, and the window's."""
        sinks = min(count, self.sinks)
        recent = min(count - sinks, self.window - 1)
        self._sink.read_state(state.scope("sink"), sinks, dtype, heads, dim)
        self._recent.read_state(state.scope("recent"), recent, dtype, heads, dim)
        self._count = count

    def live_nbytes(self) -> int:
        return self._sink.live_nbytes() + self._recent.live_nbytes()
