"""The engine protocol. `Engine` is the one type every command and harness holds: `KvEngine`s keep
decode state and run the FFN they are handed; `RetrievalEngine`s serve from a store, compute
with the model's own FFN and are not for live decode. Their typed failures are in `errors`.

Output contract: `prefill` and `decode_step` return the pre-final-norm hidden state of the last
position, shape [1, H]; the caller turns it into logits with `layer.final_logits`.

The base class does what every engine shares, so an engine writes only its state policy: an
empty prompt is refused, decode before prefill is refused, the token is embedded, the backend
and the absolute position are recorded, the decode step is profiled, and `info()` ends with the
memory the engine holds. An engine implements `_start` (prompt rows [S, H] at positions 0.. →
hidden rows ending with the prompt's last, [≥1, H]) and `_step` (one row [1, H] at
`self.position` → [1, H]); an engine whose state is token ids, or whose step reads the token
on the device, overrides `_start_tokens` / `_step_token` instead, and then cannot start from
hidden rows.

Batched decode: engines whose `batch_key()` is equal (not None) decode one step together
(`larql.inference.batching.decode_batch`): their class's `_step_batch` takes one input row per
engine [B, H] and reads the weights once for all of them, each row attending over its own
engine's state. An engine whose key is None steps alone. An engine class that also implements
`_advance_batch` takes several rows per engine in such a step (`batching.advance_batch`): a
new prompt, or a chunk of one, rides in the running sessions' decode step instead of taking a
forward pass of its own; a fresh engine says with `prompt_batch_key` whose steps its prompt
may ride in.

Work in bounded parts, for a server whose turns must stay short: `prefill_part` takes a prompt
a part at a time with the rows and state of one whole prefill (`takes_prompt_in_parts`),
`finish_prompt` then does in parts the work an engine's policy does on a whole prompt (coding,
evicting), and `decode_step_parts` splits a step whose work grows with the context
(`step_work`: `no-cache` re-runs every position).

State snapshots: an engine declares its state — `write_state` hands over named tensors and
typed plain fields, `read_state` takes them back into an engine freshly built from the same
spec, checking each against what the spec and the model imply (`larql.inference.snapshots`).
Nothing else of the engine is saved, and nothing in a saved state names code. `fork` copies the
state in memory the same way; an engine that cannot save its state now says why in
`snapshot_refusal` (one with work in parts still under way cannot).
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

import torch

from larql.inference.errors import BackendUnavailable, EmptyPrompt, InvariantViolation
from larql.inference.ffn import FfnBackend
from larql.inference.layer import embed_rows, per_layer_inputs, token_tensor
from larql.inference.memory import MemoryBreakdown
from larql.inference.profiling import DecodeStageSummary, EngineProfiler
from larql.inference.snapshots import (
    SnapshotUnsupported,
    StateReader,
    StateWriter,
    fork_state,
)
from larql.models.model import Model


@dataclass(frozen=True)
class EngineInfo:
    name: str
    description: str
    backend: str
    config: str = ""

    @property
    def label(self) -> str:
        """`name [backend] (config)`: which engine ran, where, how."""
        return f"{self.name} [{self.backend}]" + (f" ({self.config})" if self.config else "")

    def summary(self) -> str:
        return f"{self.label}  {self.description}"


def backend_name(model: Model) -> str:
    return model.device.type


class Engine(ABC):
    name: ClassVar[str] = ""
    # the version of the state `write_state` declares: a state of another version is refused
    STATE_VERSION: ClassVar[int] = 1
    # `fork_part_way` copies a prompt's state at its part boundaries (for a prefix cache)
    leaves_part_way_states: ClassVar[bool] = False
    # FFN backend kinds (`FfnBackend.kind`) it may not run with, and why: its catalog entry's
    # `refuses_ffn`, set when the engine is built from a spec
    refused_ffn: Mapping[str, str] = MappingProxyType({})

    def __init__(self, profiling: bool = False) -> None:
        self.position = 0  # absolute position of the next token
        self._backend = "cpu"
        self._prefilled = False
        self._profiler = EngineProfiler(enabled=profiling)
        self.spec_string: str | None = None  # the canonical spec it was built from, if any
        # work a prompt taken in parts left for once it is whole (`finish_prompt`): each item
        # does a part of it → the rows it took
        self._finishing: list[Callable[[], int]] = []

    # ------------------------------------------------------------------ what the engine holds

    @abstractmethod
    def memory(self) -> MemoryBreakdown: ...

    @abstractmethod
    def describe(self) -> str:
        """What the engine keeps, in a few words (`info()` adds the memory)."""

    def config(self) -> str:
        """Its parameters as `key=value,…` (empty: none)."""
        return ""

    def info(self) -> EngineInfo:
        return EngineInfo(
            self.name, f"{self.describe()} ({self.memory().brief()})", self._backend, self.config()
        )

    def memory_bytes(self) -> int:
        """Everything held: the state and the growth reserve (`memory()` splits them)."""
        return self.memory().total

    def cold_bytes(self) -> int:
        return self.memory().cold

    def window_tokens(self) -> int:
        """Tokens in the engine's active (hot) window."""
        return 0

    def stage_summary(self) -> DecodeStageSummary | None:
        return self._profiler.summary(self.name, self._backend)

    def dispatch_path(self) -> str | None:
        return "per-layer"

    def supports_multimodal(self) -> bool:
        """Whether the engine can start from hidden rows (e.g. image embeddings)."""
        return False

    # ------------------------------------------------------------------ the protocol

    def expect_tokens(self, total: int) -> None:
        """A generation will hold up to `total` tokens (prompt and new ones): an engine whose
        state grows with them may allocate it once instead of growing it as they come. A hint
        only: holding more still works; by default nothing changes."""
        return None

    def prefill(self, model: Model, ffn: FfnBackend, token_ids: Sequence[int]) -> torch.Tensor:
        """Run the prompt; return the last position's pre-final-norm hidden [1, H]."""
        return self.prefill_all(model, ffn, token_ids)[-1:]

    def prefill_all(self, model: Model, ffn: FfnBackend, token_ids: Sequence[int]) -> torch.Tensor:
        """`prefill`, returning every hidden row the engine computed, ending with the prompt's
        last ([S, H] for an engine that runs the whole prompt at once)."""
        if len(token_ids) == 0:
            raise EmptyPrompt()
        self._check_ffn(ffn)
        self._backend = backend_name(model)
        rows = self._start_tokens(model, ffn, list(token_ids))
        self._started(len(token_ids))
        return rows

    def prefill_from_hidden(
        self, model: Model, ffn: FfnBackend, initial_hidden: torch.Tensor
    ) -> torch.Tensor:
        """Prefill from given input rows [N, H] (e.g. image embeddings) instead of token ids."""
        if initial_hidden.shape[0] == 0:
            raise EmptyPrompt()
        self._check_ffn(ffn)
        self._backend = backend_name(model)
        inputs = per_layer_inputs(model, initial_hidden)  # [N, L, P] or None
        rows = self._start(model, ffn, initial_hidden, inputs)
        self._started(initial_hidden.shape[0])
        return rows[-1:]

    def _check_ffn(self, ffn: FfnBackend) -> None:
        """Refuse an FFN backend of a kind this engine may not run with (`refused_ffn`)."""
        for kind in sorted(ffn.kinds()):
            reason = self.refused_ffn.get(kind)
            if reason is not None:
                raise BackendUnavailable(f"{self.name} cannot run with {kind}: it {reason}")

    def extends_exactly(self, model: Model) -> bool:
        """Whether, on `model`, `extend` continues a prefill as one longer prefill would (up to
        the order of float sums), so a long prompt may be prefilled in chunks between other
        sessions' steps."""
        return False

    def extend(self, model: Model, ffn: FfnBackend, token_ids: Sequence[int]) -> torch.Tensor:
        """Append several tokens after the prefill in one pass (a prefill's next chunk) → the
        last one's hidden [1, H]."""
        return self.extend_all(model, ffn, token_ids)[-1:]

    def extend_all(self, model: Model, ffn: FfnBackend, token_ids: Sequence[int]) -> torch.Tensor:
        """`extend`, returning every new row's hidden [S, H]."""
        self._require_prefill()
        if len(token_ids) == 0:
            raise EmptyPrompt()
        rows, inputs = embed_rows(model, token_tensor(model, list(token_ids)))  # [S, H], …
        hidden = self._extend(model, ffn, rows, inputs)
        self.position += len(token_ids)
        return hidden

    # ------------------------------------------------------------------ work in bounded parts

    def takes_prompt_in_parts(self, model: Model) -> bool:
        """Whether `prefill_part` takes a prompt a part at a time with the state and rows of one
        whole prefill (up to the order of float sums), so a server can put a long prompt in
        over several turns with other sessions' steps between them. By default where
        `extend` continues a prefill exactly."""
        return self.extends_exactly(model)

    def prefill_part(
        self, model: Model, ffn: FfnBackend, token_ids: Sequence[int], more: bool
    ) -> torch.Tensor:
        """The next part of a prompt (the first part starts the prefill; `more`: more of the
        prompt follows) → every hidden row the engine computed for it, ending with its last
        ([n, H] where it computes them all). Only where `takes_prompt_in_parts`: an engine may
        hold what the next part needs until the last part comes."""
        if not self._prefilled:
            return self.prefill_all(model, ffn, token_ids)
        return self.extend_all(model, ffn, token_ids)

    def finish_prompt(self, rows: int) -> bool:
        """After `prefill_part`'s last part: the next part, about `rows` rows, of the work the
        engine's policy does once the prompt is whole (coding its K/V, re-deriving what a
        lossy tier changed) → whether none is left. Its next step does whatever is left first.
        Most engines leave none."""
        done = 0
        while self._finishing and done < rows:
            done += self._finishing.pop(0)()
        return not self._finishing

    def step_work(self) -> int:
        """Rows of work the next decode step does: 1 for an engine that keeps what its step
        needs; more for one that recomputes from the context every step (`no-cache` re-runs
        every position), which `decode_step_parts` can then split."""
        return 1

    def decode_step_parts(
        self, model: Model, ffn: FfnBackend, token_id: int, rows: int
    ) -> Iterator[torch.Tensor | None]:
        """`decode_step` in parts of about `rows` rows of work each (`step_work`): None after
        each part but the last, whose value is the hidden [1, H]. The step takes effect with
        its last part; an engine abandoned part-way through one is in no defined state (drop
        it). By default the whole step is one part."""
        yield self.decode_step(model, ffn, token_id)

    def _extend(
        self, model: Model, ffn: FfnBackend, rows: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """rows [S, H] at positions `self.position`.. (their per-layer inputs [S, L, P] or
        None, `layer.per_layer_inputs`) → their hidden rows [S, H]."""
        raise BackendUnavailable(f"{self.name} cannot extend a prefill in one pass")

    def decode_step(self, model: Model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        """Append one token at the next absolute position; return its hidden [1, H]."""
        self._require_prefill()
        with self._profiler.stage("decode_total", model.device):
            hidden = self._step_token(model, ffn, token_id)
        self.position += 1
        return hidden

    def decode_step_from_hidden(
        self, model: Model, ffn: FfnBackend, hidden_row: torch.Tensor
    ) -> torch.Tensor:
        """`decode_step` from a given input row [1, H] instead of a token id."""
        self._require_prefill()
        with self._profiler.stage("decode_total", model.device):
            inputs = per_layer_inputs(model, hidden_row)  # [1, L, P] or None
            hidden = self._step(model, ffn, hidden_row, inputs)
        self.position += 1
        return hidden

    # ------------------------------------------------------------------ batched decode

    def batch_key(self) -> Hashable | None:
        """Engines with equal keys (not None) can decode one step together: same class, and
        whatever else their shared step needs to agree on. None: this engine steps alone."""
        return None

    @classmethod
    def _step_batch(
        cls,
        engines: Sequence[Engine],
        model: Model,
        ffn: FfnBackend,
        rows: torch.Tensor,
        inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        """One decode step for every engine at once: rows [B, H], row i engine i's input at its
        own `position`, with their per-layer inputs [B, L, P] (or None) → hidden [B, H]
        (positions are advanced by the caller)."""
        raise BackendUnavailable(f"{cls.name} cannot decode in a batch")

    def withdraws_steps(self) -> bool:
        """Whether `withdraw_step` can take this engine's last decode step back exactly."""
        return False

    def withdraw_step(self) -> None:
        """Take the last decode step back: it was launched before the step that ended the
        session had been read (`larql.inference.lookahead`). Only where `withdraws_steps`."""
        raise BackendUnavailable(f"{self.name} cannot take a decode step back")

    @property
    def prefilled(self) -> bool:
        """Whether a prompt (or its first chunk) is in."""
        return self._prefilled

    def joining_batch_key(self, model: Model) -> Hashable | None:
        """The key whose batched steps this engine's next rows may go into: its `batch_key`
        once a prompt is in, else its `prompt_batch_key`."""
        return self.batch_key() if self._prefilled else self.prompt_batch_key(model)

    def prompt_batch_key(self, model: Model) -> Hashable | None:
        """For an engine with no prompt in yet: the `batch_key` it will have once it has one,
        where its prompt (or a chunk of it) may go into a batched step beside engines of that
        key (`_advance_batch`, `_begin_in_batch`); None: its prompt goes in on its own."""
        return None

    def _begin_in_batch(self, model: Model) -> None:
        """Make the empty state a prompt's rows are written into by `_advance_batch`."""
        raise BackendUnavailable(f"{self.name} cannot take its prompt in a batched step")

    @classmethod
    def _advance_batch(
        cls,
        engines: Sequence[Engine],
        model: Model,
        ffn: FfnBackend,
        rows: torch.Tensor,
        counts: Sequence[int],
        inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        """`_step_batch` with counts[i] rows for engine i, one after another in rows [R, H]
        (engine i's next tokens at positions `position`..: a decode row, or a prompt's chunk
        that attends causally within itself) → their hidden rows [R, H]."""
        raise BackendUnavailable(f"{cls.name} cannot take several rows per engine in a batch")

    # ------------------------------------------------------------------ snapshots

    def snapshot_refusal(self) -> str | None:
        """Why this engine cannot save its state now; None: it can."""
        return None

    def write_state(self, state: StateWriter) -> None:
        """Hand over the state: what the spec and the model do not rebuild, as named tensors
        and plain fields (the position is the caller's)."""
        raise SnapshotUnsupported(self.name, "it does not declare its state (write_state)")

    def read_state(self, state: StateReader, model: Model) -> None:
        """Take back what `write_state` handed over, into this engine freshly built from the
        same spec, checking every field and tensor against the spec and `model` (`position`
        is set already)."""
        raise SnapshotUnsupported(self.name, "it does not declare its state (read_state)")

    def prompt_part_way(self) -> bool:
        """Whether a prompt is part-way in (`prefill_part` with more to come): its state is not
        one a snapshot or a fork can take."""
        return False

    def fork(self, model: Model) -> Engine:
        """An independent copy of this engine and its state on `model` (decoding one leaves
        the other)."""
        return self._fork_holding(model)

    def _fork_holding(
        self, model: Model, state: StateWriter | None = None, position: int | None = None
    ) -> Engine:
        """`fork`; with `state`, a state this engine wrote of its first `position` positions
        (on its device), a copy holding that instead of the whole state."""
        clone = fork_state(self, model, state, position)
        clone._finishing = []
        clone._profiler = EngineProfiler(enabled=self._profiler.enabled)
        return clone

    def fork_prefix(self, model: Model, tokens: int) -> Engine | None:
        """An independent copy holding this engine's state of its first `tokens` positions, for
        a prefix cache; None where it cannot make one. An exact engine's copy is the state a
        prefill of those tokens leaves; a lossy engine's is what it kept of them (rows coded or
        evicted over the longer context stay so). By default only the whole state:
        `tokens` == `position`, where a snapshot can be taken."""
        if tokens != self.position or not self._forkable():
            return None
        try:
            return self.fork(model)
        except SnapshotUnsupported:
            return None

    def fork_part_way(self, model: Model) -> Engine | None:
        """While a prompt goes in a part at a time (`prefill_part` with more to come): an
        independent copy, part-way at the same point, whose next parts (`prefill_part`) go on
        as this engine's would — for a prefix cache, where the state after a whole prompt
        cannot be cut back to a prefix (an eviction's rows depend on the whole prompt); None
        by default and where no prompt is part-way. An engine that makes such copies says so
        in `leaves_part_way_states`."""
        return None

    def _forkable(self) -> bool:
        """Whether the state now is one a fork can take: a prompt whole in, the work its policy
        does on it done, and nothing that refuses a snapshot."""
        if not self._prefilled or self._finishing or self.prompt_part_way():
            return False
        return self.snapshot_refusal() is None

    def restored(self, model: Model) -> None:
        """After `read_state`: the state now lives on `model`'s device."""
        self._backend = backend_name(model)
        self._prefilled = True

    # ------------------------------------------------------------------ the state policy

    def _start_tokens(self, model: Model, ffn: FfnBackend, token_ids: list[int]) -> torch.Tensor:
        return self._start(model, ffn, *embed_rows(model, token_tensor(model, token_ids)))

    def _start(
        self, model: Model, ffn: FfnBackend, rows: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """rows [S, H] from position 0 and their per-layer inputs [S, L, P] (None: the model
        has none) → the rows' hidden [S, H]."""
        raise BackendUnavailable(f"{self.name} cannot prefill from hidden states")

    def _step_token(self, model: Model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        with self._profiler.stage("embed", model.device):
            row, inputs = embed_rows(model, token_tensor(model, [token_id]))  # [1, H], …
        return self._step(model, ffn, row, inputs)

    def _step(
        self, model: Model, ffn: FfnBackend, row: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        raise BackendUnavailable(f"{self.name} cannot decode from a hidden state")

    def _started(self, prompt_tokens: int) -> None:
        self.position = prompt_tokens
        self._prefilled = True

    def _require_prefill(self) -> None:
        """The prompt is in, and its state final (work `finish_prompt` had left is done)."""
        if not self._prefilled:
            raise InvariantViolation("decode_step called before prefill")
        if self._finishing:
            self.finish_prompt(sys.maxsize)


class KvEngine(Engine):
    """Keeps decode state across tokens; the FFN is whatever backend the caller hands in."""


class RetrievalEngine(Engine):
    """Serves from a store instead of keeping K/V, and computes with the model's own FFN (the
    one handed in is not used): bench and accuracy only, never live decode."""

    def index_context(self, model: Model, text: str) -> None:
        """Make `text` what the engine retrieves from (its store, when none is attached): the
        long-context suite compresses a context this way, then asks the question as the prompt."""
        raise NotImplementedError(f"{self.name} cannot index a context")

    def snapshot_refusal(self) -> str | None:
        return "a retrieval engine serves from its store and keeps no decode state to save"
