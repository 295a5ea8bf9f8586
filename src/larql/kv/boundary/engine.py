"""`boundary-kv`: a `standard` engine that also emits a boundary frame at the end of every chunk
of `chunk_tokens` tokens — the residual there, how confident the model was, and whether an int8
copy would still predict the same token.

Decoding is done entirely by the inner `StandardEngine`, so the output is the standard output.
Frames are emitted at every multiple of `chunk_tokens` the sequence reaches, including those
crossed inside the prompt at prefill (the reference emits one only when the prompt length itself
is a multiple). The frame for token_end = e carries the hidden of position e − 1 (the last layer's
output, before the final norm) and the chunk's token ids. Frames live in the archive, not in the
engine's memory; the engine holds only the ids of the chunk under way.
"""

from __future__ import annotations

import copy
import secrets
import time
from collections.abc import Sequence

import torch

from larql.errors import LarqlError
from larql.inference.engine import KvEngine
from larql.inference.errors import BackendFailure
from larql.inference.ffn import FfnBackend
from larql.inference.layer import final_logits
from larql.inference.memory import MemoryBreakdown
from larql.inference.snapshots import SnapshotCorrupt, StateReader, StateWriter, restore_into
from larql.kv.boundary import codecs
from larql.kv.boundary.archive import BoundaryArchive, InMemoryBoundaryArchive
from larql.kv.boundary.frames import (
    FRAME_VERSION,
    Agreement,
    BoundaryFormatError,
    BoundaryFrame,
    BoundaryMetadata,
    BoundaryModelIdentity,
    BoundaryPayload,
)
from larql.kv.boundary.gate import GateConfig, payload_plan
from larql.kv.boundary.identity import model_identity
from larql.kv.spec import EngineBuildError
from larql.kv.standard import StandardEngine
from larql.models.model import Model
from larql.specs import PLAIN_NAME

DEFAULT_CHUNK_TOKENS = 512
AGREEMENT_CODEC = "int8_clip3sigma"


def fresh_sequence_id() -> str:
    """A sequence id no other run has used: `seq-20261130T110502-3f9a1c` (UTC, then random)."""
    return f"seq-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


class BoundaryKvEngine(KvEngine):
    name = "boundary-kv"
    STATE_VERSION = 2  # 2 added `chunk_ids`

    def __init__(
        self,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        sequence_id: str | None = None,
        window: int | None = None,
        archive: BoundaryArchive | None = None,
        identity: BoundaryModelIdentity | None = None,
        gate: GateConfig | None = None,
        verify_agreement: bool = True,
    ) -> None:
        if chunk_tokens < 1:
            raise EngineBuildError(f"boundary-kv: chunk_tokens must be ≥ 1, got {chunk_tokens}")
        super().__init__()
        self.chunk_tokens = chunk_tokens
        self.sequence_id = sequence_id if sequence_id is not None else fresh_sequence_id()
        self.run_id = secrets.token_hex(8)  # recorded in every frame this engine writes
        self.window = window
        self.inner = StandardEngine(window)
        self.archive = archive if archive is not None else InMemoryBoundaryArchive()
        self._refuse_a_sequence_of_another_run()
        self.identity = identity
        self.gate = gate or GateConfig()
        self.verify_agreement = verify_agreement
        self.frames_emitted = 0
        self.payload_bytes_emitted = 0
        self.chunk_ids: list[int] = []  # the ids since the last multiple of chunk_tokens

    def snapshot_refusal(self) -> str | None:
        if not isinstance(self.archive, InMemoryBoundaryArchive):
            return "its frames go to an archive on disk, which a restored run would write twice"
        return self.inner.snapshot_refusal()

    def prompt_part_way(self) -> bool:
        return self.inner.prompt_part_way()

    def write_state(self, state: StateWriter) -> None:
        """The inner standard engine's state (`inner.*`), the sequence and run ids, the ids of
        the chunk under way (`chunk_ids`), and the frames emitted so far: their metadata
        (`frames`, plain data) and payloads (`frames.N`, uint8)."""
        self.inner.write_state(state.scope("inner"))
        state.put("sequence_id", self.sequence_id)
        state.put("run_id", self.run_id)
        state.put("chunk_ids", list(self.chunk_ids))
        frames = self.frames()
        state.put("frames", [frame.to_json() for frame in frames])
        for index, frame in enumerate(frames):
            payload = torch.frombuffer(bytearray(frame.payload.data), dtype=torch.uint8)
            state.tensor(f"frames.{index}", payload)

    def read_state(self, state: StateReader, model: Model) -> None:
        self.inner = copy.copy(self.inner)  # (a fork's inner engine must not be the original's)
        restore_into(self.inner, state.scope("inner"), model, self.position)
        sequence = state.text("sequence_id", PLAIN_NAME.pattern)
        if self.spec_string and "sequence_id=" in self.spec_string and sequence != self.sequence_id:
            raise SnapshotCorrupt(
                f"the state's sequence {sequence!r} is not its spec's {self.sequence_id!r}"
            )
        self.sequence_id = sequence
        self.run_id = state.text("run_id", r"[0-9a-f]{1,64}")
        self.chunk_ids = self._read_chunk_ids(state, model)
        documents = state.plain("frames")
        if not isinstance(documents, list) or len(documents) > self.position // self.chunk_tokens:
            raise SnapshotCorrupt(
                f"state field 'frames' must list at most one frame per {self.chunk_tokens} tokens"
            )
        self.archive = InMemoryBoundaryArchive()
        for index, document in enumerate(documents):
            self._restore_frame(state, index, document, model)
        frames = self.frames()
        self.frames_emitted = len(frames)
        self.payload_bytes_emitted = sum(frame.payload.nbytes for frame in frames)

    def _read_chunk_ids(self, state: StateReader, model: Model) -> list[int]:
        ids = state.plain("chunk_ids")
        vocab = model.config.vocab_size
        if (
            not isinstance(ids, list)
            or len(ids) != self.position % self.chunk_tokens
            or not all(type(t) is int and 0 <= t < vocab for t in ids)
        ):
            raise SnapshotCorrupt(
                f"state field 'chunk_ids' must list the {self.position % self.chunk_tokens} "
                f"token ids (below {vocab}) since the last multiple of {self.chunk_tokens}"
            )
        return ids

    def _restore_frame(
        self, state: StateReader, index: int, document: object, model: Model
    ) -> None:
        """One frame of a saved state, checked: this sequence's, at a chunk's end, of this model."""
        found = state.tensors.get(f"{state.prefix}frames.{index}")
        size = 0 if found is None else found.numel()
        payload = state.tensor(f"frames.{index}", torch.uint8, (size,))
        try:
            if not isinstance(document, dict):
                raise BoundaryFormatError("a frame is not a JSON object")
            frame = BoundaryFrame.from_json(document, payload.cpu().numpy().tobytes())
        except BoundaryFormatError as e:
            raise SnapshotCorrupt(f"state frame {index}: {e}") from None
        end = frame.token_end
        if (
            frame.sequence_id != self.sequence_id
            or type(end) is not int
            or not 0 < end <= self.position
            or end % self.chunk_tokens
            or frame.hidden_size != model.config.hidden_size
        ):
            raise SnapshotCorrupt(
                f"state frame {index} is not a frame of this sequence at a chunk's end"
            )
        self.archive.append(frame)

    def describe(self) -> str:
        return (
            f"standard K/V + boundary-frame emission every {self.chunk_tokens} tokens "
            f"(archived={self.frames_emitted} frames, {self.payload_bytes_emitted} payload "
            f"bytes in {self.archive.describe()})"
        )

    def config(self) -> str:
        window = self.window if self.window is not None else "full"
        return f"chunk_tokens={self.chunk_tokens},sequence_id={self.sequence_id},window={window}"

    def memory(self) -> MemoryBreakdown:
        return self.inner.memory()  # frames are in the archive, reported in describe()

    def window_tokens(self) -> int:
        return self.inner.window_tokens()

    def _start_tokens(self, model: Model, ffn: FfnBackend, token_ids: list[int]) -> torch.Tensor:
        rows = self.inner.prefill_all(model, ffn, token_ids)  # [S, H]
        self.chunk_ids = []
        self._take(model, rows, token_ids, 0)
        return rows

    def _take(
        self, model: Model, rows: torch.Tensor, token_ids: Sequence[int], before: int
    ) -> None:
        """Tokens `token_ids` went in at positions before.. with hidden rows [n, H]: a frame at
        every multiple of `chunk_tokens` they reach."""
        for index, token_id in enumerate(token_ids):
            self.chunk_ids.append(int(token_id))
            end = before + index + 1
            if end % self.chunk_tokens == 0:
                self._emit(model, rows[index : index + 1], end, tuple(self.chunk_ids))
                self.chunk_ids = []

    def extends_exactly(self, model: Model) -> bool:
        return self.inner.extends_exactly(model)

    def extend_all(self, model: Model, ffn: FfnBackend, token_ids: Sequence[int]) -> torch.Tensor:
        """The inner engine's next rows [n, H], with a frame at every multiple of
        `chunk_tokens` they reach (as one longer prefill emits them)."""
        self._require_prefill()
        before = self.inner.position
        rows = self.inner.extend_all(model, ffn, token_ids)  # [n, H]
        self._take(model, rows, token_ids, before)
        self.position = self.inner.position
        return rows

    def _step_token(self, model: Model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        hidden = self.inner.decode_step(model, ffn, token_id)  # [1, H]
        self._take(model, hidden, [token_id], self.inner.position - 1)
        return hidden

    def frames(self) -> list[BoundaryFrame]:
        """This engine's sequence chain, in token order."""
        return self.archive.load_chain(self.sequence_id)

    def _refuse_a_sequence_of_another_run(self) -> None:
        """An archive never mixes two runs in one sequence: frames of this sequence that are
        already there were written by another run, and this one would overwrite some of them
        and leave the rest."""
        try:
            held = self.archive.load_chain(self.sequence_id) if self.archive.exists() else []
        except LarqlError as e:
            raise EngineBuildError(f"boundary-kv: cannot read the archive: {e}") from None
        if held:
            raise EngineBuildError(
                f"boundary-kv: {self.archive.describe()} already holds sequence "
                f"{self.sequence_id!r} ({len(held)} frames, tokens up to {held[-1].token_end}, "
                f"from another run); give another sequence_id=, leave it out for a fresh one, "
                f"or use another archive="
            )

    def _emit(
        self, model: Model, row: torch.Tensor, token_end: int, token_ids: tuple[int, ...]
    ) -> None:
        if row.is_meta:  # a model's structure (`larql memory`): no values to frame, nothing held
            return
        if self.identity is None:
            self.identity = model_identity(model)
        frame = build_frame(
            model,
            row,
            token_start=max(token_end - self.chunk_tokens, 0),
            token_end=token_end,
            sequence_id=self.sequence_id,
            identity=self.identity,
            gate=self.gate,
            verify_agreement=self.verify_agreement,
            run_id=self.run_id,
            token_ids=token_ids,
        )
        try:
            self.archive.append(frame)
        except Exception as e:  # any archive failure surfaces as the typed engine error
            raise BackendFailure(f"boundary frame emit failed: {e}") from e
        self.frames_emitted += 1
        self.payload_bytes_emitted += frame.payload.nbytes


def boundary_metadata(
    model: Model, row: torch.Tensor, gate: GateConfig, verify_agreement: bool
) -> BoundaryMetadata:
    """row: [1, H] pre-final-norm hidden → metadata from its raw logits."""
    logits = final_logits(model, row)[0].double()  # [V]
    log_probs = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logits, 2)
    top1, top2 = int(top.indices[0]), int(top.indices[1])
    log_prob_margin = float(log_probs[top1] - log_probs[top2])
    top1_prob = float(log_probs[top1].exp())
    agreement = Agreement.NOT_CHECKED
    if verify_agreement:
        decoded = codecs.round_trip(AGREEMENT_CODEC, row[0])  # float32 [H]
        restored = decoded.to(device=row.device, dtype=row.dtype).view(1, -1)
        agrees = int(final_logits(model, restored)[0].argmax()) == top1
        agreement = Agreement.AGREES if agrees else Agreement.DISAGREES
    return BoundaryMetadata(
        top1_token_id=top1,
        top1_logit=float(top.values[0]),
        top2_token_id=top2,
        top2_logit=float(top.values[1]),
        raw_logit_margin=float(top.values[0] - top.values[1]),
        raw_log_prob_margin=log_prob_margin,
        raw_top1_prob=top1_prob,
        agreement=agreement,
        codec_fragile=agreement is Agreement.DISAGREES,
        boundary_fragile=gate.boundary_fragile(log_prob_margin, top1_prob),
        top1_text=model.tokenizer.decode([top1]),
    )


def build_frame(
    model: Model,
    row: torch.Tensor,
    token_start: int,
    token_end: int,
    sequence_id: str,
    identity: BoundaryModelIdentity,
    gate: GateConfig,
    verify_agreement: bool = True,
    run_id: str = "",
    token_ids: tuple[int, ...] | None = None,
) -> BoundaryFrame:
    """The frame for the chunk [token_start, token_end) from the hidden row [1, H] of position
    token_end − 1 and the chunk's token ids."""
    metadata = boundary_metadata(model, row, gate, verify_agreement)
    codec, contract = payload_plan(gate.decide(metadata.agreement, metadata.boundary_fragile))
    data = b"" if codec == "none" else codecs.encode(codec, row[0])
    return BoundaryFrame(
        version=FRAME_VERSION,
        identity=identity,
        sequence_id=sequence_id,
        boundary_id=f"{sequence_id}:{token_end}",
        token_start=token_start,
        token_end=token_end,
        layer=model.config.num_layers - 1,
        hidden_size=model.config.hidden_size,
        metadata=metadata,
        payload=BoundaryPayload(codec, data, contract),
        run_id=run_id,
        token_ids=token_ids,
    )
