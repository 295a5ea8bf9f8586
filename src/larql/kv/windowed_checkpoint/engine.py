"""`windowed-checkpoint` (alias `unlimited-context`): tumbling windows of W tokens, each seeded
by a one-row K/V checkpoint of the previous window's last token.

A token in window w ≥ 1 attends to that checkpoint row (at its true absolute position
w·W − 1) plus the tokens of window w so far — nothing earlier; window 0 attends normally, so the
engine is exact vs `standard` inside the first window and deliberately lossy after it (DESIGN
decision 2: the third meaning of "window"). Memory stays O(W) for K/V: when a window fills, its
last row on every layer becomes the checkpoint, its token ids go to the archive, and its K/V is
dropped. `replay_window(id)` rebuilds a closed window's K/V from the previous checkpoint and the
archived tokens.

A chunk of tokens that falls inside one window runs as one batched attention call (the K/V sink
hands back [checkpoint ; window rows so far ; new rows] and `attend` masks causally within the
chunk) — the same result as feeding the tokens one at a time. A prompt that spans several
windows is one pass too: a checkpoint is nothing but a row of the previous window, so every
layer attends over the whole prompt with the tumbling-window mask (a query sees its own
window's earlier tokens and the last token of the window before), then the windows are closed
from the rows it computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from larql.inference.engine import KvEngine
from larql.inference.errors import EmptyPrompt, InvariantViolation
from larql.inference.ffn import FfnBackend
from larql.inference.layer import FreshKv, attention_block, embed_rows, ffn_block, token_tensor
from larql.inference.memory import MemoryBreakdown
from larql.inference.shared_kv import SharedKv, shares
from larql.inference.snapshots import StateReader, StateWriter
from larql.kv.buffers import KvBuffer
from larql.kv.spec import EngineBuildError
from larql.kv.windowed_checkpoint.checkpoints import (
    Checkpoint,
    CheckpointStore,
    TokenArchive,
    WindowedCheckpointStats,
)
from larql.models.config import ModelConfig
from larql.models.model import Model

DEFAULT_WINDOW = 512

LayerKv = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [Hkv, n, D]
Stage = Callable[[str, torch.device], AbstractContextManager[None]]


def _unprofiled(name: str, device: torch.device) -> AbstractContextManager[None]:
    return nullcontext()


_NONE = torch.empty(0)  # a checkpoint's row for a layer that shares another's K/V


class WindowedCheckpointEngine(KvEngine):
    name = "windowed-checkpoint"

    def __init__(self, window: int = DEFAULT_WINDOW, profiling: bool = False) -> None:
        if window < 1:  # a zero-token window would never close
            raise EngineBuildError(f"windowed-checkpoint: window must be ≥ 1, got {window}")
        super().__init__(profiling)
        self.window = window
        self._reset()

    def _reset(self) -> None:
        # Per layer: [checkpoint row (windows ≥ 1) ; rows of the current window].
        self._layers: list[KvBuffer] | None = None
        self._seeded = False  # whether the current window's buffers start with a checkpoint row
        self.checkpoints = CheckpointStore()
        self.archive = TokenArchive()
        self.window_id = 0  # id of the open window
        self.offset = 0  # absolute position of the open window's first token
        self._model: Model | None = None
        self._ffn: FfnBackend | None = None

    # ------------------------------------------------------------------ protocol

    def describe(self) -> str:
        return (
            f"window-boundary K/V checkpoints + token replay (windows={len(self.checkpoints)}, "
            f"tokens={self.archive.total_tokens})"
        )

    def config(self) -> str:
        return f"window={self.window}"

    def memory(self) -> MemoryBreakdown:
        return MemoryBreakdown.of(hot=self._layers or [], cold=[self.checkpoints, self.archive])

    def window_tokens(self) -> int:
        return len(self.archive.pending)

    def _start_tokens(self, model: Model, ffn: FfnBackend, token_ids: list[int]) -> torch.Tensor:
        self._reset()
        self._model, self._ffn = model, ffn
        self._layers = [KvBuffer() for _ in range(model.config.num_layers)]
        if len(token_ids) <= self.window:
            return self._process(model, ffn, token_ids)
        return self._prefill_across_windows(model, ffn, token_ids)

    def _step_token(self, model: Model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        return self._process(model, ffn, [token_id], self._profiler.stage)

    # ------------------------------------------------------------------ saved state

    def write_state(self, state: StateWriter) -> None:
        """Every token id (`ids`), each layer's checkpoint rows of the closed windows
        (`checkpoints.N.k`, `.v`: [windows, Hkv, D]) and, while a window is open, each layer's
        rows of it (`layers.N.*`, its checkpoint row first)."""
        closed = [self.archive.get(w) for w in range(len(self.archive))]
        ids = [w.token_ids.cpu() for w in closed if w is not None]
        pending = torch.tensor(self.archive.pending, dtype=torch.int32)
        state.tensor("ids", torch.cat([*ids, pending]))
        found = [self.checkpoints.get(w) for w in range(len(self.checkpoints))]
        checkpoints = [c for c in found if c is not None]
        for layer in range(len(self._layers or [])):
            rows = [(c.keys[layer], c.values[layer]) for c in checkpoints if c.keys[layer].numel()]
            if rows:  # [Hkv, 1, D] each → [windows, Hkv, D]
                scoped = state.scope(f"checkpoints.{layer}")
                scoped.tensor("k", torch.cat([k for k, _ in rows], dim=1).transpose(0, 1))
                scoped.tensor("v", torch.cat([v for _, v in rows], dim=1).transpose(0, 1))
        if self.archive.pending:
            for layer, buffer in enumerate(self._layers or []):
                buffer.write_state(state.scope(f"layers.{layer}"))

    def read_state(self, state: StateReader, model: Model) -> None:
        """The windows `position` tokens make: `position // window` closed (their ids archived,
        a checkpoint each), the rest open — each layer's rows of it after the last
        checkpoint's."""
        self._reset()
        cfg, device = model.config, model.device
        self._model = model
        ids = state.token_ids("ids", self.position, cfg.vocab_size)
        closed, w = self.position // self.window, self.window
        layers = range(cfg.num_layers)
        shape = [(cfg.kv_heads_of(layer), cfg.head_dim_of(layer)) for layer in layers]
        rows: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for layer in range(cfg.num_layers):  # (none on a layer sharing another's K/V)
            scoped, count = state.scope(f"checkpoints.{layer}"), 0 if shares(cfg, layer) else closed
            keys = scoped.rows("k", model.dtype, count, shape[layer])
            values = scoped.rows("v", model.dtype, count, shape[layer])
            rows.append(None if keys is None or values is None else (keys, values))
        for window_id in range(closed):
            row = slice(window_id, window_id + 1)
            checkpoint = Checkpoint(
                position=(window_id + 1) * w - 1,
                keys=tuple(_NONE if r is None else r[0][row].transpose(0, 1) for r in rows),
                values=tuple(_NONE if r is None else r[1][row].transpose(0, 1) for r in rows),
            )
            self.checkpoints.put(window_id, checkpoint)
            self.archive.pending = ids[window_id * w : (window_id + 1) * w].tolist()
            self.archive.close(window_id, window_id * w, device)
        self.window_id, self.offset = closed, closed * w
        self.archive.pending = ids[self.offset :].tolist()
        self._layers = [KvBuffer() for _ in range(cfg.num_layers)]
        self._seeded = bool(self.archive.pending) and closed > 0
        if self.archive.pending:
            count = len(self.archive.pending) + int(self._seeded)
            for layer, buffer in enumerate(self._layers):
                held = 0 if shares(cfg, layer) else count
                buffer.read_state(state.scope(f"layers.{layer}"), held, model.dtype, *shape[layer])

    def extends_exactly(self, model: Model) -> bool:
        return True  # tokens fed in any chunks meet the windows they would fed one by one

    def extend_all(self, model: Model, ffn: FfnBackend, token_ids: Sequence[int]) -> torch.Tensor:
        """The next tokens window by window, as one longer prefill would take them → their
        hidden rows [n, H]."""
        self._require_prefill()
        if len(token_ids) == 0:
            raise EmptyPrompt()
        rows = self._process(model, ffn, list(token_ids))
        self.position += len(token_ids)
        return rows

    # ------------------------------------------------------------------ windows

    def _process(
        self, model: Model, ffn: FfnBackend, token_ids: list[int], stage: Stage = _unprofiled
    ) -> torch.Tensor:
        """Feed tokens window by window; a window that fills is closed at once → every token's
        hidden row [n, H]. `stage` times the decode step's parts (the prefill is not
        profiled)."""
        hidden: list[torch.Tensor] = []
        done = 0
        while done < len(token_ids):
            take = min(len(token_ids) - done, self.window - len(self.archive.pending))
            hidden.append(self._extend_current(model, ffn, token_ids[done : done + take], stage))
            done += take
            if len(self.archive.pending) == self.window:
                self._close_window(model, stage)
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden)

    def _extend_current(
        self, model: Model, ffn: FfnBackend, chunk: list[int], stage: Stage
    ) -> torch.Tensor:
        """Run `chunk` (all in the open window) through every layer → its hidden rows [n, H]."""
        assert self._layers is not None
        if not self.archive.pending:
            self._seed_window()
        start = self.offset + len(self.archive.pending)
        with stage("embed", model.device):
            h, inputs = embed_rows(model, token_tensor(model, chunk))  # [S, H], …
        shared = SharedKv(model.config)  # a K/V-sharing layer's buffer stays empty
        for layer, kv in enumerate(self._layers):
            with stage("attention", model.device):
                h = attention_block(model, layer, h, start, kv, shared=shared)
            with stage("ffn", model.device):
                h = ffn_block(model, layer, h, ffn, inputs)
        self.archive.pending.extend(chunk)
        return h

    def _prefill_across_windows(
        self, model: Model, ffn: FfnBackend, token_ids: list[int]
    ) -> torch.Tensor:
        """A prompt longer than one window in one pass per layer → every row [S, H]; leaves
        the state feeding it window by window would: closed windows checkpointed and archived,
        the open one (if any tokens are left) seeded with the last checkpoint."""
        assert self._layers is not None
        n, w = len(token_ids), self.window
        positions = torch.arange(n, device=model.device)
        window_of = positions // w
        # query i sees key j: same window (causality comes from `attend`), or j is the last
        # token of the window before i's
        allowed = (window_of.unsqueeze(1) == window_of.unsqueeze(0)) | (
            positions.unsqueeze(0) == (window_of * w - 1).unsqueeze(1)
        )  # [S, S]
        h, inputs = embed_rows(model, token_tensor(model, token_ids))  # [S, H], …
        rows: list[FreshKv] = []
        shared = SharedKv(model.config)
        for layer in range(model.config.num_layers):
            rows.append(FreshKv())
            h = attention_block(model, layer, h, 0, rows[-1], allowed=allowed, shared=shared)
            h = ffn_block(model, layer, h, ffn, inputs)
        closed = n // w
        for window_id in range(closed):
            last = (window_id + 1) * w - 1
            self.archive.pending = token_ids[window_id * w : last + 1]
            self.checkpoints.put(window_id, self._rows_at(rows, last, last + 1))
            self.archive.close(window_id, window_id * w, model.device)
        self.window_id, self.offset = closed, closed * w
        self._seed_window()
        if self.offset < n:
            self.archive.pending = token_ids[self.offset :]
            for layer, kv in enumerate(self._layers):
                k, v = rows[layer].k, rows[layer].v
                if k is not None and v is not None:  # (a K/V-sharing layer has none)
                    kv.append(k[:, self.offset :], v[:, self.offset :])
        return h

    @staticmethod
    def _rows_at(rows: list[FreshKv], start: int, end: int) -> Checkpoint:
        """The K/V rows start..end−1 of every layer as a checkpoint (the row end − 1's; none for
        a layer sharing another's K/V)."""
        keys = tuple(_NONE if r.k is None else r.k[:, start:end].clone() for r in rows)
        values = tuple(_NONE if r.v is None else r.v[:, start:end].clone() for r in rows)
        return Checkpoint(position=end - 1, keys=keys, values=values)

    def _seed_window(self) -> None:
        """Start the open window: empty K/V, or the previous window's checkpoint row."""
        assert self._layers is not None
        previous = self.checkpoints.get(self.window_id - 1)
        for layer, kv in enumerate(self._layers):
            kv.truncate(0)
            if previous is not None and previous.keys[layer].numel():
                kv.append(previous.keys[layer], previous.values[layer])
        self._seeded = previous is not None

    def _close_window(self, model: Model, stage: Stage = _unprofiled) -> None:
        """Checkpoint the last row of every layer, archive the ids, drop the window's K/V."""
        assert self._layers is not None
        with stage("state_capture", model.device):
            n = len(self.archive.pending)
            checkpoint = Checkpoint(
                position=self.offset + n - 1,
                keys=tuple(kv.keys[:, -1:].clone() if len(kv) else _NONE for kv in self._layers),
                values=tuple(
                    kv.values[:, -1:].clone() if len(kv) else _NONE for kv in self._layers
                ),
            )
            self.checkpoints.put(self.window_id, checkpoint)
            self.archive.close(self.window_id, self.offset, model.device)
            for kv in self._layers:
                kv.truncate(0)
            self._seeded = False
            self.offset += n
            self.window_id += 1

    def flush(self) -> None:
        """Close the open window now, as if it had filled (the end of a document, say): its last
        row on every layer becomes a checkpoint, its ids go to the archive, its K/V is dropped;
        the next token opens a window seeded with that checkpoint. Nothing open: no change."""
        if not self.archive.pending or self._model is None:
            return
        self._close_window(self._model)

    # ------------------------------------------------------------------ introspection

    def key_positions(self) -> range:
        """Absolute positions of the K/V rows the next token will attend to (besides itself)."""
        n = len(self.archive.pending)
        if n == 0:  # the next token opens a new window
            has_checkpoint = self.window_id - 1 in self.checkpoints
            return range(self.offset - int(has_checkpoint), self.offset)
        return range(self.offset - int(self._seeded), self.offset + n)

    def current_window_kv(self) -> LayerKv:
        """K/V of the open window's own tokens (checkpoint row excluded), per layer."""
        if self._layers is None or not self.archive.pending:
            return []
        assert self._model is not None
        return self._per_layer(self._model.config, self._layers, int(self._seeded))

    def replay_window(
        self, window_id: int, model: Model | None = None, ffn: FfnBackend | None = None
    ) -> LayerKv:
        """Rebuild closed window `window_id`'s K/V from checkpoint `window_id − 1` (none for
        window 0) and the archived tokens, at their absolute positions → per layer
        (keys, values) [Hkv, n, D], the window's own rows. Defaults to the model and FFN of the
        last prefill."""
        model = model or self._model
        ffn = ffn or self._ffn
        archived = self.archive.get(window_id)
        if archived is None or model is None or ffn is None:
            raise InvariantViolation(
                f"replay_window({window_id}): no closed window with that id "
                f"(closed: {len(self.archive)})"
            )
        previous = self.checkpoints.get(window_id - 1)
        sinks = [KvBuffer() for _ in range(model.config.num_layers)]
        shared = SharedKv(model.config)
        with torch.inference_mode():
            h, inputs = embed_rows(model, archived.token_ids.long())  # [n, H], …
            for layer, kv in enumerate(sinks):
                if previous is not None and previous.keys[layer].numel():
                    kv.append(previous.keys[layer], previous.values[layer])
                h = attention_block(model, layer, h, archived.offset, kv, shared=shared)
                h = ffn_block(model, layer, h, ffn, inputs)
        return self._per_layer(model.config, sinks, int(previous is not None))

    @staticmethod
    def _per_layer(config: ModelConfig, buffers: list[KvBuffer], skip: int) -> LayerKv:
        """Each layer's (keys, values) past the first `skip` rows; a K/V-sharing layer's are
        its source's."""
        owners = [config.kv_source_of(layer) for layer in range(len(buffers))]
        owners = [layer if source is None else source for layer, source in enumerate(owners)]
        return [
            (buffers[i].keys[:, skip:].clone(), buffers[i].values[:, skip:].clone()) for i in owners
        ]

    def stats(self) -> WindowedCheckpointStats:
        tokens = self.archive.total_tokens
        per_token = self._model.config.kv_bytes_per_token(2) if self._model is not None else 0
        return WindowedCheckpointStats(
            windows=len(self.checkpoints),
            tokens=tokens,
            equivalent_kv_bytes=tokens * per_token,
            checkpoint_bytes=self.checkpoints.nbytes(),
            archive_bytes=self.archive.nbytes(),
        )

    def summary(self) -> str:
        return self.stats().summary()
