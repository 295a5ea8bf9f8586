"""The prefill and decode walk every residual-stream engine shares.

An engine of this family is configured by two things only: the hot-tier `window` and the cold
codec of each layer. The walk stores each layer's pre-layer residual, runs the shared attention
block with the layer's derivative K/V buffer as its sink, runs the caller's FFN, then evicts hot
rows beyond the window into the cold tier. A lossless cold tier leaves the evicted rows' K/V as
they are; a lossy one replaces them with K/V recomputed from the stored (round-tripped) rows at
their true positions — one row per layer per step, O(1).

Attention is always over the full history (docs/DESIGN.md, decision 2: `window` only splits
storage), so with a lossless cold tier the engine is exact against `standard` at any window.

`kv_cache=False` is the recompute mode: no K/V is kept between steps; each step rebuilds every
layer's K/V from the stored residuals (hot and cold) through the same projection code, so the
state is the residuals alone — fewer bytes than a full K/V cache only where a row's K and V
together are wider than its residual (no grouped-query attention), and a projection of the
whole history per layer per step.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from functools import partial

import torch

from larql.inference.batching import RowsFailed
from larql.inference.engine import Engine, KvEngine, backend_name
from larql.inference.errors import BackendUnavailable, EmptyPrompt, InvariantViolation
from larql.inference.ffn import FfnBackend
from larql.inference.fused_layer import fused_layers_rows, layers_compile, rows_kv
from larql.inference.layer import attention_block, embed_rows, ffn_block, token_tensor
from larql.inference.memory import MemoryBreakdown
from larql.inference.profiling import EngineProfiler
from larql.inference.shared_kv import SharedKv, shares
from larql.inference.snapshots import StateReader, StateWriter
from larql.kv.buffers import KvBuffer, commit_step, step_rows, step_slots
from larql.kv.reserved_rows import prompt_in_one_call, rows_reserved
from larql.kv.residual.codecs import new_codec
from larql.kv.residual.store import EvictedRows, ResidualStore
from larql.models.model import Model

_NOT_PROFILED = EngineProfiler(enabled=False)  # prefill is not part of the decode breakdown


def check_preconditions(model: Model, engine: str) -> None:
    """Refuse an architecture or a RoPE scaling whose layer state is not a function of
    (pre-layer residual, absolute position): storing residuals instead of K/V would not be
    exact there."""
    arch = model.config.arch
    if not arch.residual_is_sufficient:
        raise BackendUnavailable(
            f"{engine} needs layer state that is a function of the pre-layer residual and the "
            f"absolute position; architecture {arch.name!r} does not guarantee it"
        )
    scaled = {spec.rope.scaling for spec in model.config.layers if spec.rope.length_dependent}
    if scaled:
        # a row's K depends on the sequence length it was first rotated at, which a recompute
        # from the stored residual cannot know
        raise BackendUnavailable(
            f"{engine} recomputes K/V from residuals and the position, but RoPE scaling "
            f"{', '.join(sorted(scaled))!r} rotates keys by the sequence length; use standard "
            f"or no-cache"
        )


class ResidualStreamEngine(KvEngine):
    """Base of markov-rs, markov-rs-codec and boundary-per-layer; subclasses choose codecs."""

    def __init__(
        self,
        window: int | None = None,
        profiling: bool = False,
        model: Model | None = None,
        kv_cache: bool = True,
    ) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window must be ≥ 1, got {window}")
        super().__init__(profiling)
        self.window = window
        self.kv_cache = kv_cache  # False: K/V recomputed from the residuals every step
        self._store: ResidualStore | None = None
        self._expected = 0  # tokens a generation expects to hold (`expect_tokens`)
        if model is not None:
            self.validate_for(model)

    # ------------------------------------------------------------------ configuration

    def validate_for(self, model: Model) -> None:
        """Raise a typed error if this engine cannot decode with `model` (build or prefill)."""
        check_preconditions(model, self.name)

    def codec_labels(self, model: Model) -> list[str]:
        """The cold codec of each layer."""
        raise NotImplementedError

    def config(self) -> str:
        window = f"window={self.window}" if self.window is not None else "window=full"
        return window if self.kv_cache else f"{window},kv_cache=0"

    # ------------------------------------------------------------------ state and accounting

    @property
    def store(self) -> ResidualStore:
        self._require_prefill()
        assert self._store is not None
        return self._store

    def memory(self) -> MemoryBreakdown:
        return self._store.memory() if self._store is not None else MemoryBreakdown()

    def window_tokens(self) -> int:
        return self._store.hot_len if self._store is not None else 0

    def supports_multimodal(self) -> bool:
        return True

    def expect_tokens(self, total: int) -> None:
        """The derivative K/V of every position is allocated for `total` tokens at once."""
        self._expected = total
        if self._store is not None:
            self._store.expect(total)

    def drop_derivative(self) -> None:
        """Forget all cached K/V; the next step recomputes them from the stored residuals."""
        self.store.drop_derivative()

    def write_state(self, state: StateWriter) -> None:
        """The residual store's rows (`store.*`)."""
        self.store.write_state(state.scope("store"))

    def fork_prefix(self, model: Model, tokens: int) -> Engine | None:
        """The rows of the first `tokens` positions, copied alone: each position's residuals are
        those a prefill of the first `tokens` tokens computes (a row depends only on the rows
        before it), and the derivative K/V rows of those positions are theirs, so with a
        lossless cold tier (`markov-rs`; the codec engines without a window, or on a bfloat16
        model) the copy is exactly the state such a prefill leaves. Rows the longer context
        had moved to the cold tier stay there as they are stored — coded by a lossy tier, their
        K/V the ones re-derived from the coded rows — where a prefill of the prefix alone would
        have kept the last `window` of them hot and exact: what the engine kept of them. Every
        codec codes a row on its own, so no row of the prefix depends on those cut off."""
        if tokens == self.position or not 0 < tokens < self.position or not self._forkable():
            return super().fork_prefix(model, tokens)
        state = StateWriter(keep_device=True)
        self.store.write_state(state.scope("store"), tokens)
        return self._fork_holding(model, state, tokens)

    def read_state(self, state: StateReader, model: Model) -> None:
        store = self._new_store(model)
        store.read_state(state.scope("store"), model, self.position)
        self._store = store

    # ------------------------------------------------------------------ prefill

    def _start(
        self, model: Model, ffn: FfnBackend, rows: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """rows: [S, H] at positions 0.. → every row's hidden [S, H]."""
        store = self._new_store(model)
        assert store.kv is not None
        h = _prompt_in_one_call(model, ffn, rows, store) if inputs is None else None
        if h is None:
            h = rows
            shared = SharedKv(model.config)
            for layer, buffer in enumerate(store.kv):
                store.push(layer, h)
                h = attention_block(model, layer, h, 0, buffer, shared=shared)
                h = ffn_block(model, layer, h, ffn, inputs)
        store.advance(rows.shape[0])
        self._store = store
        _evict_rows([self], model, ffn, profiled=False)
        if not self.kv_cache:
            store.drop_derivative()
        return h

    # ------------------------------------------------------------------ decode

    def _step(
        self, model: Model, ffn: FfnBackend, row: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """row: [1, H] at the next absolute position → its pre-final-norm hidden [1, H]."""
        return self._rows(model, ffn, row, inputs)

    def takes_prompt_in_parts(self, model: Model) -> bool:
        return True  # its evictions wait for the last part (`prefill_part`)

    def prefill_part(
        self, model: Model, ffn: FfnBackend, token_ids: Sequence[int], more: bool
    ) -> torch.Tensor:
        """The prompt a part at a time, each part's rows attending over the exact K/V of the
        parts before; the evictions into the cold tier (and, without `kv_cache`, dropping the
        K/V) wait for the last part, as a whole prefill makes them once the prompt is in, and
        the K/V of rows a lossy tier changed are re-derived a layer at a time
        (`finish_prompt`) → the part's rows [n, H]."""
        if len(token_ids) == 0:
            raise EmptyPrompt()
        first = not self._prefilled
        if first:
            self._check_ffn(ffn)
            self._backend = backend_name(model)
            self._store = self._new_store(model)
        store = self._store
        assert store is not None and store.kv is not None
        rows, inputs = embed_rows(model, token_tensor(model, list(token_ids)))  # [n, H], …
        h, start = rows, store.next_position
        shared = SharedKv(model.config)
        for layer, buffer in enumerate(store.kv):
            store.push(layer, h)
            h = attention_block(model, layer, h, start, buffer, shared=shared)
            h = ffn_block(model, layer, h, ffn, inputs)
        store.advance(len(token_ids))
        if first:
            self._started(len(token_ids))
        else:
            self.position += len(token_ids)
        if not more:
            self._finishing = [partial(self._evict_prompt, model, store)]
        return h

    def _evict_prompt(self, model: Model, store: ResidualStore) -> int:
        """A whole prompt's next `PROMPT_EVICTION_ROWS` rows past the window into the cold
        tier (the rest after, in further parts), the K/V of those a lossy tier changed
        re-derived a layer a part; without `kv_cache`, the K/V dropped once all are out
        → the rows evicted."""
        held = store.hot_len
        evicted = store.evict_overflow(most=PROMPT_EVICTION_ROWS)
        if self.kv_cache and evicted is not None:
            self._finishing += [
                partial(_rederive_layer, model, store, evicted, column)
                for column in range(len(evicted.layers))
            ]
        if store.window is not None and store.hot_len > store.window:
            self._finishing.append(partial(self._evict_prompt, model, store))
        elif not self.kv_cache:
            store.drop_derivative()  # (re-derived K/V would be dropped with the rest)
        return held - store.hot_len

    def step_work(self) -> int:
        """Without `kv_cache`, a step first rebuilds every position's K/V."""
        if self.kv_cache or self._store is None or self._store.kv is not None:
            return 1
        return self.position

    def decode_step_parts(
        self, model: Model, ffn: FfnBackend, token_id: int, rows: int
    ) -> Iterator[torch.Tensor | None]:
        """Without `kv_cache`: the K/V rebuilt from the residuals a few layers a part (about
        `rows` positions' K/V each), then the step over them."""
        store = self.store
        if store.kv is None:
            buffers: list[KvBuffer] = []
            done = 0
            for layer in range(store.num_layers):
                buffer = store.rebuild_cold_kv(model, layer)
                store.rebuild_hot_kv(model, layer, buffer)
                buffers.append(buffer)
                done += store.next_position
                if done >= rows:
                    done = 0
                    yield None
            store.kv = buffers
        yield self.decode_step(model, ffn, token_id)

    def extends_exactly(self, model: Model) -> bool:
        """Where every layer's cold tier is lossless for the model's dtype (`markov-rs`; the bf16
        tier on a bfloat16 model), or no row ever goes cold (no window): a later chunk then
        attends over the K/V a whole prefill computes. A lossy tier re-derives an evicted row's
        K/V from its stored form, which a whole prefill's later rows never see."""
        if self.window is None:
            return True
        labels = set(self.codec_labels(model))
        return all(new_codec(label).lossless_for(model.dtype) for label in labels)

    def _extend(
        self, model: Model, ffn: FfnBackend, rows: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """rows [S, H] at the next positions (a prefill's next chunk) → their hidden [S, H]."""
        if not self.extends_exactly(model):
            raise BackendUnavailable(
                f"{self.name} extends a prefill only with a lossless cold tier on this model "
                f"(or no window)"
            )
        return self._rows(model, ffn, rows, inputs)

    def _rows(
        self, model: Model, ffn: FfnBackend, rows: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """rows [S, H] at the next positions → their hidden [S, H]: every layer in one compiled
        call where it applies, else layer by layer; then the evictions (one decode row's
        timed in the engine's breakdown)."""
        n = rows.shape[0]
        if inputs is None and (fused := _fused_rows([self], model, ffn, rows, [n])) is not None:
            return fused
        store, prof, h = self.store, self._profiler, rows
        position = store.next_position
        device = model.device
        shared = SharedKv(model.config)
        for layer, buffer in enumerate(self._derivative_kv(model, prof)):
            with prof.stage("state_append", device):
                store.push(layer, h)
            with prof.stage("attention", device):
                h = attention_block(model, layer, h, position, buffer, shared=shared)
            with prof.stage("ffn", device):
                h = ffn_block(model, layer, h, ffn, inputs)
        store.advance(n)
        _evict_rows([self], model, ffn, profiled=n == 1)
        if not self.kv_cache:
            store.drop_derivative()
        return h

    def _new_store(self, model: Model) -> ResidualStore:
        """An empty store for this engine's configuration on `model` (typed refusal where the
        engine cannot run it)."""
        self.validate_for(model)
        cfg = model.config
        keeps = [not shares(cfg, layer) for layer in range(cfg.num_layers)]
        store = ResidualStore(self.window, self.codec_labels(model), keeps)
        store.expect(self._expected)
        return store

    # ------------------------------------------------------------------ batched decode

    def batch_key(self) -> Hashable | None:
        """Engines of one class and configuration batch while they keep K/V (`kv_cache`)."""
        if self._store is None or not self.kv_cache:
            return None
        return (type(self), self.config())

    def prompt_batch_key(self, model: Model) -> Hashable | None:
        """A fresh engine's prompt may ride in the steps of its kind where it keeps K/V."""
        if not self.kv_cache or model.config.shares_kv:
            return None
        return (type(self), self.config())

    def _begin_in_batch(self, model: Model) -> None:
        self._store = self._new_store(model)

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
        """counts[i] rows for engine i in rows [R, H] → [R, H]: a decode row, a new prompt, or
        (with a lossless cold tier) a prompt's next chunk; every layer of every session in one
        compiled call where it applies, else each engine's own step or prefill in turn."""
        batch = [e for e in engines if isinstance(e, ResidualStreamEngine)]
        assert len(batch) == len(engines), "batch keys group only residual-stream engines"
        for engine, n in zip(batch, counts, strict=True):
            if engine.prefilled and n != 1 and not engine.extends_exactly(model):
                raise InvariantViolation(
                    "a residual-stream engine with a lossy cold tier takes one row a step once "
                    "started"
                )
        if inputs is None and (fused := _fused_rows(batch, model, ffn, rows, counts)) is not None:
            return fused
        hidden, offset = [], 0
        failures: dict[int, Exception] = {}
        for i, (engine, n) in enumerate(zip(batch, counts, strict=True)):
            part, extra = rows[offset : offset + n], None
            if inputs is not None:
                extra = inputs[offset : offset + n]
            run = engine._start if not engine.prefilled else engine._rows
            try:  # each engine's own step: its failure fails it alone
                hidden.append(run(model, ffn, part, extra))
            except Exception as e:
                failures[i] = e
                hidden.append(torch.zeros_like(part))
            offset += n
        if failures:
            raise RowsFailed(torch.cat(hidden), failures)
        return torch.cat(hidden)

    @classmethod
    def _step_batch(
        cls,
        engines: Sequence[Engine],
        model: Model,
        ffn: FfnBackend,
        rows: torch.Tensor,
        inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        """rows: [B, H] → [B, H]: `_advance_batch` with a row each (every layer of every
        session in one compiled call where it applies, else each session's own step)."""
        return cls._advance_batch(engines, model, ffn, rows, [1] * len(engines), inputs)

    def _derivative_kv(self, model: Model, prof: EngineProfiler) -> list[KvBuffer]:
        """Each layer's K/V of positions [0, next_position), rebuilt if it was dropped."""
        store = self.store
        if store.kv is None:
            buffers = []
            for layer in range(store.num_layers):
                with prof.stage("recompute_cold", model.device):
                    buffer = store.rebuild_cold_kv(model, layer)
                with prof.stage("recompute_hot", model.device):
                    store.rebuild_hot_kv(model, layer, buffer)
                buffers.append(buffer)
            store.kv = buffers
        return store.kv


def _prompt_in_one_call(
    model: Model, ffn: FfnBackend, rows: torch.Tensor, store: ResidualStore
) -> torch.Tensor | None:
    """A short prompt's rows [S, H] through `standard`'s one compiled call for a new prompt:
    each layer's K/V into the store's derivative buffers, each layer's input rows pushed as
    its pre-layer residuals (not yet advanced) → the hidden rows [S, H]; None where the call
    does not take them (nothing changed)."""
    if model.config.shares_kv or store.kv is None:
        return None
    inputs = rows.new_empty(model.config.num_layers, *rows.shape)  # [L, S, H]
    h = prompt_in_one_call(model, ffn, rows, store.kv, inputs)
    if h is not None:
        store.push_layers(inputs)
    return h


def _fused_rows(
    batch: Sequence[ResidualStreamEngine],
    model: Model,
    ffn: FfnBackend,
    rows: torch.Tensor,
    counts: Sequence[int],
) -> torch.Tensor | None:
    """rows [R, H]: counts[i] rows of engine i (a decode row, or a new prompt whole) → the
    hidden rows after every layer [R, H], in one compiled call (`fused_layers_rows`): each
    layer's new K/V rows written into the engine's derivative buffers, each layer's input rows
    kept and then stored as the layer's pre-layer residuals, as `_step` and `_start` do layer
    by layer; then the evictions. None where the call does not apply (nothing changed):
    derivative K/V not kept, or a layer the compiled layers do not take."""
    layers = range(model.config.num_layers)
    stores = [e._store for e in batch]
    if any(not e.kv_cache for e in batch) or any(s is None or s.kv is None for s in stores):
        return None
    if not layers_compile(model, layers, rows, ffn):
        return None
    kv = [s.kv for s in stores]  # type: ignore[union-attr]
    slots = [step_slots(buffers, n) for buffers, n in zip(kv, counts, strict=True)]  # type: ignore[arg-type]
    if all(n == 1 for n in counts) and all(slot is not None for slot in slots):
        reserved = step_rows(slots)  # type: ignore[arg-type]
    else:
        reserved = rows_reserved(model, rows, kv, counts, slots)  # type: ignore[arg-type]
    if reserved is None:
        return None
    starts = [s.next_position for s in stores]  # type: ignore[union-attr]
    inputs = rows.new_empty(len(layers), *rows.shape)  # [L, R, H]: each layer's input rows
    h = fused_layers_rows(model, layers, rows, starts, counts, [], ffn, None, reserved, inputs)
    if h is None:
        return None
    offset = 0
    for engine, store, n, slot in zip(batch, stores, counts, slots, strict=True):
        assert store is not None and store.kv is not None
        if slot is not None:
            commit_step(store.kv, n)
        else:
            for buffer in store.kv:
                buffer.commit_rows(n)
        with engine._profiler.stage("state_append", model.device):
            store.push_layers(inputs[:, offset : offset + n])
            store.advance(n)
        offset += n
    stepping = [n == 1 and e.prefilled for e, n in zip(batch, counts, strict=True)]
    _evict_rows([e for e, s in zip(batch, stepping, strict=True) if s], model, ffn)
    prompts = [e for e, s in zip(batch, stepping, strict=True) if not s]  # (not timed as steps)
    _evict_rows(prompts, model, ffn, profiled=False)
    return h


# a prompt's rows past the window go to the cold tier this many a part (`finish_prompt`): all at
# once, 7,500 rows of the default model took ~0.8 s
PROMPT_EVICTION_ROWS = 1024


def _rederive_layer(model: Model, store: ResidualStore, evicted: EvictedRows, column: int) -> int:
    """`ResidualStore.replace_kv` for one of the evicted rows' layers → the rows."""
    rows = evicted.stored[:, column : column + 1]  # [n, 1, H]
    store.replace_kv(model, EvictedRows(evicted.first_position, [evicted.layers[column]], rows))
    return rows.shape[0]


def _evict_rows(
    batch: Sequence[ResidualStreamEngine], model: Model, ffn: FfnBackend, profiled: bool = True
) -> None:
    """After a prefill or a decode step: every engine's overflowing hot rows into its cold
    tier, and the K/V of the lossily stored ones re-derived for all engines in one compiled
    call (`rows_kv`: a decode step's own projection) where it applies, else through the float
    matrices. `profiled`: timed in the engines' decode breakdown (not a prefill's)."""
    lossy: list[tuple[ResidualStore, EvictedRows]] = []
    for engine in batch:
        store = engine._store  # (a prefill's: not yet `prefilled`)
        assert store is not None
        prof = engine._profiler if profiled else _NOT_PROFILED
        with prof.stage("state_append", model.device):
            evicted = store.evict_overflow()
        if evicted is not None and store.kv is not None:
            lossy.append((store, evicted))
    if not lossy:
        return
    prof = batch[0]._profiler if profiled else _NOT_PROFILED
    with prof.stage("recompute_cold", model.device):
        if not _rows_kv_compiled(model, ffn, lossy):
            for store, evicted in lossy:
                store.replace_kv(model, evicted)


def _rows_kv_compiled(
    model: Model, ffn: FfnBackend, lossy: Sequence[tuple[ResidualStore, EvictedRows]]
) -> bool:
    """`ResidualStore.replace_kv` for every store's evicted rows at once, by the compiled
    layer (`rows_kv`) where it takes their layers (the same in every store) and their rows
    are float32 → whether it ran."""
    layers = lossy[0][1].layers
    if any(e.layers != layers or e.stored.dtype != torch.float32 for _, e in lossy):
        return False
    segments = []
    for store, evicted in lossy:
        assert store.kv is not None
        first, n = evicted.first_position, evicted.stored.shape[0]
        per_layer = []
        for layer in layers:
            keys, values = store.kv[layer]._k, store.kv[layer]._v
            if keys._data is None or values._start != keys._start or first + n > len(keys):
                return False
            per_layer.append((keys._data, values._data, keys._start + first))
        segments.append((n, first, per_layer))
    rows = torch.cat([e.stored for _, e in lossy]) if len(lossy) > 1 else lossy[0][1].stored
    return rows_kv(model, ffn, layers, rows, segments)  # type: ignore[arg-type]
