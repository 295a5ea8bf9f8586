"""Generated token ids → the text a client sees, piece by piece.

Stop tokens are dropped, incomplete UTF-8 is held back (the tokenizer's stream decoder), and so
is any tail that could still grow into a stop string: a stop string never reaches the client,
even split over several tokens, and the text before it is never delayed longer than needed.
"""

from __future__ import annotations

from collections.abc import Sequence

from larql.models.tokenizer import TextTokenizer


class TextAssembler:
    def __init__(self, tokenizer: TextTokenizer, stop_strings: Sequence[str] = ()) -> None:
        self._decoder = tokenizer.stream_decoder()
        self._stop_ids = tokenizer.stop_ids
        self._stops = tuple(s for s in stop_strings if s)
        self._pending = ""  # decoded but not yet handed out
        self.text = ""  # handed out so far
        self.hit_stop_string = False

    def feed(self, token_id: int) -> str:
        """One generated token → the text that is now safe to send (often "")."""
        if self.hit_stop_string or token_id in self._stop_ids:
            return ""
        self._pending += self._decoder.step(token_id)
        cut = self._first_stop()
        if cut is not None:
            self.hit_stop_string = True
            return self._emit(self._pending[:cut])
        held = self._longest_stop_prefix_tail()
        return self._emit(self._pending[: len(self._pending) - held])

    @property
    def decoded(self) -> int:
        """Characters decoded so far: handed out, or held back while they may start a stop
        string."""
        return len(self.text) + len(self._pending)

    def flush(self) -> str:
        """The generation ended without a stop string: what was held back is plain text."""
        return "" if self.hit_stop_string else self._emit(self._pending)

    def _emit(self, piece: str) -> str:
        self._pending = self._pending[len(piece) :]
        if self.hit_stop_string:
            self._pending = ""
        self.text += piece
        return piece

    def _first_stop(self) -> int | None:
        found = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
        return min(found) if found else None

    def _longest_stop_prefix_tail(self) -> int:
        """Length of the longest tail of the pending text that begins some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:n]):
                    best = n
                    break
        return best
