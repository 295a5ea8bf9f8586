"""What every eviction engine shares: the prefill runs exact attention over the whole prompt
and hands each layer's K/V (and queries) to the policy; decode attends over what each layer
kept, every K/V head its own rows. A layer with the architecture's own sliding window keeps
its window like `standard` (it is bounded already; under a storage, in the storage's windowed
form).

A policy may have its kept rows held by a `KeptStorage` instead of in the model's dtype —
eviction composed with a quantiser (`larql.kv.composed`): the policy still chooses the rows, the
storage codes them, appends each decoded row and runs the decode attention over what it holds.
A policy that goes on evicting as it decodes (not `compresses_once`) then rescores the storage's
rows by the weights that attention put on them and has the storage drop the rows it evicts
(`_attended`)."""

from __future__ import annotations

import copy
from abc import abstractmethod
from collections.abc import Hashable, Sequence
from functools import partial
from typing import ClassVar, Protocol

import torch

from larql.inference.engine import Engine, EngineInfo, KvEngine, backend_name
from larql.inference.errors import EmptyPrompt
from larql.inference.ffn import FfnBackend
from larql.inference.layer import (
    FreshKv,
    attend,
    attention_block,
    attention_output,
    ffn_block,
    kept_rows,
    project_qkv,
    token_tensor,
)
from larql.inference.memory import MemoryBreakdown
from larql.inference.profiling import EngineProfiler
from larql.inference.shared_kv import SharedKv, shares
from larql.inference.snapshots import StateReader, StateWriter
from larql.kv.buffers import KvBuffer
from larql.kv.eviction.ragged import RaggedRows
from larql.kv.pass_in_parts import PassInParts
from larql.models.model import Model


# ---------------------------------------------------------------- storage hook (composition)
class StoredStep(Protocol):
    """A storage's own decode step over every layer's kept rows (the quantiser's kernel path)."""

    @property
    def captured(self) -> bool:
        """Whether the step replays a captured CUDA graph."""

    def decode(
        self,
        model: Model,
        ffn: FfnBackend,
        position: int,
        token_id: int = 0,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The token (or the input row `hidden` [1, H]) at `position` through every layer, its
        K/V kept → hidden [1, H]."""

    def memory(self) -> MemoryBreakdown: ...

    def stored_rows(self, layer: int) -> int: ...

    def write_layer_state(self, layer: int, state: StateWriter) -> None:
        """The layer's rows as the storage's own store of the layer writes them."""

    def batch_key(self) -> Hashable:
        """What steps of this kind must agree on, besides their engines', to run together."""


class KeptStorage(Protocol):
    """How a full-attention layer holds the rows its policy keeps, when not as they are."""

    def hold(self, model: Model, layer: int, rows) -> object:
        """The policy's rows (`.keys`, `.values` [Hkv, n, D]) → what the layer holds."""

    def attend(
        self,
        model: Model,
        layer: int,
        held,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        position: int,
        shared: SharedKv,
    ) -> torch.Tensor:
        """The decode query q [Hq, 1, D] over `held` and the new row k, v [Hkv, 1, D], which
        it then appends → [1, q_dim]."""

    def read(self, state: StateReader, model: Model, layer: int, most: int) -> object:
        """What `hold` gave, back from a saved state of at most `most` rows."""

    def window(
        self, model: Model, layer: int, keys: torch.Tensor, values: torch.Tensor, keep: int
    ) -> object:
        """A sliding layer's rows keys, values [Hkv, n, D] → what holds its last `keep` rows
        (attended and appended to through `attend`, like the kept rows)."""

    def read_window(
        self, state: StateReader, model: Model, layer: int, keep: int, tokens: int
    ) -> object:
        """What `window` gave, back from a saved state after `tokens` tokens."""

    def settle(self, model: Model, layers: list, prompt_length: int) -> StoredStep | None:
        """The prompt's layers once each is kept (`hold`, `window`) → a decode step of the
        storage's own holding them all (their entries then None), or None (each layer holds
        what `hold` or `window` gave, now final)."""

    def resettle(self, model: Model, layers: list, position: int) -> StoredStep | None:
        """The layers read back from a saved state (`read`, `read_window`) → the step `settle`
        gives holding them (their entries then None), or None (the layers stay as read)."""

    def describe(self, fast: StoredStep | None = None) -> str:
        """What holds the kept rows (`fast`: the engine's step from `settle`)."""

    def config(self) -> str: ...

    def batch_key(self) -> Hashable:
        """What the engines whose rows it holds must agree on to decode one step together."""

    def step_batch(
        self,
        engines: Sequence[EvictingEngine],
        model: Model,
        ffn: FfnBackend,
        rows: torch.Tensor,
        inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        """`Engine._step_batch` for engines whose rows storages of its `batch_key` hold."""


# ---------------------------------------------------------------- end of the storage hook


class EvictingEngine(KvEngine):
    # the policy evicts only at the prefill; decode appends every row
    compresses_once: ClassVar[bool] = False
    leaves_part_way_states = True  # its rows depend on the whole prompt: no cut-back prefix

    def __init__(self, profiling: bool = False) -> None:
        super().__init__(profiling)
        self.storage: KeptStorage | None = None  # None: the policy's rows as they are
        self._fast: StoredStep | None = None  # the storage's own step, holding every layer
        self._layers: list = []  # per layer: a KvBuffer (sliding layers) or the policy's rows
        self._prompt: PassInParts | None = None  # a prompt part-way in (`prefill_part`)
        self._observed: list[object] = []  # per layer: what the policy keeps of its queries

    def window_tokens(self) -> int:
        if self._fast is not None:
            layers = range(len(self._layers))
            return max((self._fast.stored_rows(layer) for layer in layers), default=0)
        return max((len(layer) for layer in self._layers), default=0)

    def supports_multimodal(self) -> bool:
        return True

    def memory(self) -> MemoryBreakdown:
        if self._fast is not None:
            return self._fast.memory()
        held = MemoryBreakdown.of(hot=self._layers)
        if self._prompt is not None:  # a prompt part-way in: its exact K/V so far
            held = held + MemoryBreakdown(hot=self._prompt.nbytes())
        return held

    def dispatch_path(self) -> str | None:
        if self._fast is None:
            return None
        return "cuda-graph" if self._fast.captured else "static"

    def info(self) -> EngineInfo:
        if self.storage is None:
            return super().info()
        described = f"{self.describe()}; {self.storage.describe(self._fast)}"
        config = f"{self.config()}+{self.storage.config()}"
        brief = self.memory().brief()
        return EngineInfo(self.name, f"{described} ({brief})", self._backend, config)

    def batch_key(self) -> Hashable | None:
        """Sessions whose kept rows storages of one kind hold batch (the storage steps them);
        the policy's own rows step alone."""
        if self.storage is None or not self._prefilled:
            return None
        fast = None if self._fast is None else self._fast.batch_key()
        return (type(self), self.config(), self.storage.batch_key(), fast)

    @classmethod
    def _step_batch(
        cls,
        engines: Sequence[Engine],
        model: Model,
        ffn: FfnBackend,
        rows: torch.Tensor,
        inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        evicting = [e for e in engines if isinstance(e, EvictingEngine)]
        storage = evicting[0].storage
        assert storage is not None and len(evicting) == len(engines), "batch_key groups these"
        return storage.step_batch(evicting, model, ffn, rows, inputs)

    def _kept(self, model: Model, layer: int, rows) -> object:
        """The policy's rows of a full-attention layer → what the layer holds."""
        return rows if self.storage is None else self.storage.hold(model, layer, rows)

    def _window(self, model: Model, layer: int, k: torch.Tensor, v: torch.Tensor) -> object:
        """A sliding layer's rows k, v [Hkv, n, D] → what holds the rows its later queries can
        still see: its window, as they are or in the storage's windowed form."""
        window = model.config.layers[layer].sliding_window
        keep = kept_rows(window)
        assert keep is not None, "only a sliding layer keeps a window"
        if self.storage is not None:
            return self.storage.window(model, layer, k, v, keep)
        buffer = KvBuffer(keep=keep)
        buffer.append(k, v)
        buffer.clip()
        return buffer

    def prompt_part_way(self) -> bool:
        return self._prompt is not None

    def write_state(self, state: StateWriter) -> None:
        """Each layer's kept rows (`layers.N.*`: their count `rows` and what holds them), in
        one form whether the storage's own step holds them or each layer's store does."""
        for layer, rows in enumerate(self._layers):
            scoped = state.scope(f"layers.{layer}")
            if rows is not None:
                rows.write_state(scoped)
                continue
            assert self._fast is not None, "only the storage's step takes a layer's rows"
            scoped.put("rows", self._fast.stored_rows(layer))
            self._fast.write_layer_state(layer, scoped)

    def read_state(self, state: StateReader, model: Model) -> None:
        """Each layer's rows: none on a layer sharing another's K/V, a sliding layer's window,
        else what the policy keeps of `position` tokens (`_read_kept`)."""
        cfg = model.config
        self._layers, self._prompt, self._observed, self._fast = [], None, [], None
        for layer in range(cfg.num_layers):
            scoped = state.scope(f"layers.{layer}")
            shape = (model.dtype, cfg.kv_heads_of(layer), cfg.head_dim_of(layer))
            window = cfg.layers[layer].sliding_window
            if window is not None and not shares(cfg, layer) and self.storage is not None:
                keep = kept_rows(window)
                assert keep is not None
                read = self.storage.read_window(scoped, model, layer, keep, self.position)
                self._layers.append(read)
            elif shares(cfg, layer) or window is not None:
                buffer = KvBuffer() if window is None else KvBuffer(keep=kept_rows(window))
                held = 0 if shares(cfg, layer) else self.position
                kept = held if buffer.keep is None else min(held, buffer.keep)
                buffer.read_state(scoped, kept, *shape)
                self._layers.append(buffer)
            elif self.storage is not None:
                self._layers.append(self.storage.read(scoped, model, layer, self.position))
            else:
                self._layers.append(self._read_kept(scoped, *shape))
        if self.storage is not None:
            self._fast = self.storage.resettle(model, self._layers, self.position)

    @abstractmethod
    def _read_kept(self, state: StateReader, dtype: torch.dtype, heads: int, dim: int):
        """A layer's rows as the policy keeps them after `position` tokens."""

    @abstractmethod
    def _compressed(
        self, model: Model, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ):
        """The rows the policy keeps of a prompt's q [Hq, S, D], k, v [Hkv, S, D]."""

    @abstractmethod
    def _attended(self, model: Model, layer: int, rows, q: torch.Tensor) -> None:
        """After a decode step attended over `rows` (the new one included): evict if due."""

    @abstractmethod
    def _observe(
        self,
        model: Model,
        layer: int,
        held: object,
        q: torch.Tensor,
        start: int,
        keys: torch.Tensor,
    ) -> object:
        """A prompt taken in parts: what the policy keeps of a part's queries q [Hq, n, D]
        (positions start..; keys [Hkv, start + n, D] are the prompt's so far), with `held`
        (None at the first part) what it kept of the parts before."""

    @abstractmethod
    def _compressed_from(
        self, model: Model, layer: int, held: object, k: torch.Tensor, v: torch.Tensor
    ):
        """`_compressed` of a prompt taken in parts, from what `_observe` kept of its queries."""

    def takes_prompt_in_parts(self, model: Model) -> bool:
        return True  # its policy reads the parts' queries and cuts the K/V once at the end

    def prefill_part(
        self, model: Model, ffn: FfnBackend, token_ids: Sequence[int], more: bool
    ) -> torch.Tensor:
        """The prompt through one pass over its exact K/V, a part at a time (`PassInParts`),
        the policy reading each part's queries; once it is whole, each layer keeps what one
        whole prefill keeps, a layer at a time (`finish_prompt`) → the part's rows [n, H]."""
        if self._prompt is None:
            if len(token_ids) == 0:
                raise EmptyPrompt()
            self._check_ffn(ffn)
            self._backend = backend_name(model)
            self._prompt = PassInParts(model)
            self._observed = [None] * model.config.num_layers
        ids = token_tensor(model, list(token_ids))
        rows = self._prompt.run(model, ffn, ids, partial(self._observe_part, model))
        self.position = self._prompt.length
        if more:
            return rows
        prompt, observed = self._prompt, self._observed
        self._prompt, self._observed, self._layers = None, [], []
        self._finishing = [
            partial(self._keep_prompt_layer, model, layer, exact, held)
            for layer, (exact, held) in enumerate(zip(prompt.layers, observed, strict=True))
        ]
        self._finishing.append(partial(self._settle, model, prompt.length))
        self._started(prompt.length)
        return rows

    def fork_part_way(self, model: Model) -> Engine | None:
        """`Engine.fork_part_way`: a copy of the parts' exact K/V and of what the policy read of
        their queries, which goes on taking the prompt as this engine would."""
        if self._prompt is None or not self._prompt.length:
            return None
        clone = copy.copy(self)
        clone._profiler = EngineProfiler(enabled=self._profiler.enabled)
        with torch.inference_mode():
            clone._prompt = self._prompt.copy()
            clone._observed = copy.deepcopy(self._observed)
        clone._layers, clone._fast, clone._finishing = [], None, []
        return clone

    def _keep_prompt_layer(self, model: Model, layer: int, exact: KvBuffer, held: object) -> int:
        """What layer `layer` keeps of a whole prompt's exact K/V (its policy's rows, or its
        own window's) → the prompt's rows. Layers are kept in order."""
        window = model.config.layers[layer].sliding_window
        if shares(model.config, layer):
            self._layers.append(KvBuffer())
        elif window is not None:
            self._layers.append(self._window(model, layer, exact.keys, exact.values))
        else:
            kept = self._compressed_from(model, layer, held, exact.keys, exact.values)
            self._layers.append(self._kept(model, layer, kept))
        return len(exact)

    def _settle(self, model: Model, prompt_length: int) -> int:
        """Every layer kept: the storage's own step takes them where it has one → 0 (rows of
        the prompt's work: `finish_prompt` counts the layers')."""
        self._fast = None
        if self.storage is not None:
            self._fast = self.storage.settle(model, self._layers, prompt_length)
        return 0

    def _observe_part(
        self, model: Model, layer: int, q: torch.Tensor, start: int, kv: KvBuffer
    ) -> None:
        """A part's queries q [Hq, n, D] at positions start.. (its layer's own) → what the
        policy keeps of them."""
        if shares(model.config, layer) or model.config.layers[layer].sliding_window is not None:
            return
        self._observed[layer] = self._observe(
            model, layer, self._observed[layer], q, start, kv.keys
        )

    def _start(
        self, model: Model, ffn: FfnBackend, rows: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """rows: [S, H] → every prompt row's hidden [S, H]."""
        h = rows
        self._layers = []
        shared = SharedKv(model.config)
        for layer in range(model.config.num_layers):
            if shares(model.config, layer):  # attends its source's rows; keeps none (empty)
                h = attention_block(model, layer, h, 0, FreshKv(), shared=shared)
                h = ffn_block(model, layer, h, ffn, inputs)
                self._layers.append(KvBuffer())
                continue
            q, k, v = project_qkv(model, layer, h, 0)
            shared.keep(layer, k, v)
            attn = attend(model, layer, q, k, v, 0, None)  # exact over the prompt
            h = ffn_block(model, layer, attention_output(model, layer, h, attn), ffn, inputs)
            if model.config.layers[layer].sliding_window is not None:
                self._layers.append(self._window(model, layer, k, v))
            else:
                kept = self._compressed(model, layer, q, k, v)
                self._layers.append(self._kept(model, layer, kept))
        self._settle(model, rows.shape[0])
        return h

    def _step_token(self, model: Model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        if self._fast is not None:  # embeds on the device (a captured graph)
            return self._fast.decode(model, ffn, self.position, token_id=token_id)
        return super()._step_token(model, ffn, token_id)

    def _step(
        self, model: Model, ffn: FfnBackend, row: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        if self._fast is not None:  # (a model with per-layer inputs never takes it)
            return self._fast.decode(model, ffn, self.position, hidden=row)
        h = row
        shared = SharedKv(model.config)
        for layer, rows in enumerate(self._layers):
            if shares(model.config, layer):
                h = attention_block(model, layer, h, self.position, rows, shared=shared)
                h = ffn_block(model, layer, h, ffn, inputs)
                continue
            q, k, v = project_qkv(model, layer, h, self.position)
            sliding = model.config.layers[layer].sliding_window is not None
            if self.storage is not None:  # the kept rows, or a sliding layer's window, coded
                attn = self.storage.attend(model, layer, rows, q, k, v, self.position, shared)
                if not sliding:
                    self._attended(model, layer, rows, q)
                h = ffn_block(model, layer, attention_output(model, layer, h, attn), ffn, inputs)
                continue
            if isinstance(rows, RaggedRows):  # each K/V head its own rows (never a K/V source)
                rows.append(k, v)
                attn = rows.attend(model, layer, q)
                self._attended(model, layer, rows, q)
                h = ffn_block(model, layer, attention_output(model, layer, h, attn), ffn, inputs)
                continue
            keys, values = rows.append(k, v)
            shared.keep(layer, keys, values)
            # one query sees every kept row (a sliding layer's KvBuffer holds just its window)
            attn = attend(model, layer, q, keys, values, self.position, None)
            if isinstance(rows, KvBuffer) and model.config.layers[layer].sliding_window:
                rows.clip()
            else:
                self._attended(model, layer, rows, q)
            h = ffn_block(model, layer, attention_output(model, layer, h, attn), ffn, inputs)
        return h
