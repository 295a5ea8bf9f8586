"""`turbo-quant`: K/V kept only in quantised form (TurboQuant-style).

Prefill attends over the exact K/V of the prompt (so its output equals `standard`'s), then stores
each layer's K/V encoded. Every decode step, per layer: decode the stored rows, attend over
[decoded history ; exact new row], then encode only the new row and append it (append-only: a
stored row is never re-encoded). The decoded history is a temporary, never kept, so the memory
held is the encoded bytes alone; decoding is O(T) per step by nature, done for a whole layer at
once.

The attention runs in the codec's rotated basis: a stored row is x = ‖x‖·u·R with R orthogonal
and symmetric, so q·x = ‖x‖·u·(q·R) and Σ pᵢ·xᵢ = (Σ pᵢ·‖xᵢ‖·uᵢ)·R. The step rotates q and the
new row once, attends over the rows as stored (centroids × norm, no per-row rotation) and
rotates the output back: the same attention, without the [T, D] × [D, D] product per layer that
decoding every row costs. A head width that the codec pads to a power of two D' works the same
way: q and the new row are zero-padded (so the padded coordinates, which hold only quantisation
noise, meet zeros) and the rotated-back output is cut to D.

On the CPU, a float32 model's codes (one codec for K and V) are encoded by the compiled
extension, and its full-attention layers attend over the codes in place (`coded_cpu`: one call
per layer scores and weighs the coded rows without decoding them into a copy and merges the
exact rows), the same attention within float32 rounding. Where the compiled layer takes every
layer (plain layers in GGUF blocks), the whole step — one session's or a batch's — is one call
(`coded_layers`), the same arithmetic bit for bit.

On CUDA (where Triton runs) the step takes `KernelPath` instead: the codes in fixed slots,
attention read straight from them with the rotations inside the kernel and the new row encoded by
the launch that merges the attention — 3 launches per layer for what the torch path does in ~35,
2 where the queries' rotation and the partial attention run as one CUDA C++ launch
(`cuda_partial`: 4-bit codes, heads of 64, bfloat16, full-attention layers; `attention=triton`
keeps the Triton launches) — and the whole step captured in a CUDA graph (`graph=0`: the same
step run eagerly), with the same levers (exact sink and recent rows, centering, norm
correction) and the same bytes. `attention=sdpa`, separate
`k_bits` / `v_bits` or another codec keep the torch path there; the tests hold the two equal.

Each K and V row is encoded per head (per head_dim chunk) by a `RowCodec`, by default
`TurboQuantCodec(head_dim, bits)`. One token's entry in a layer's store is
[K head 0 … K head Hkv−1, V head 0 … V head Hkv−1], each a codec vector. On an architecture's
sliding layers only the rows a later query can still see are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from functools import partial
from types import ModuleType

import torch

import larql.kernels
from larql.inference.batching import IsolatedRows
from larql.inference.engine import Engine, KvEngine, backend_name
from larql.inference.errors import EmptyPrompt, InvariantViolation
from larql.inference.ffn import FfnBackend
from larql.inference.layer import (
    FreshKv,
    attend,
    attention_block,
    attention_output,
    batched_layer_step,
    effective_window,
    ffn_block,
    kept_rows,
    project_q,
    project_qkv,
    token_tensor,
)
from larql.inference.memory import MemoryBreakdown
from larql.inference.shared_kv import SharedKv, shares
from larql.inference.snapshots import StateReader, StateWriter, declared_state
from larql.kernels.cpu import cpu_extension
from larql.kv.buffers import KvBuffer
from larql.kv.pass_in_parts import PassInParts
from larql.kv.reserved_rows import prompt_in_one_call
from larql.kv.turbo_quant.codec import RowCodec, TurboQuantCodec
from larql.kv.turbo_quant.coded_cpu import attend_coded, codes_in_place
from larql.kv.turbo_quant.coded_layers import coded_layers_step
from larql.kv.turbo_quant.compiled_codec import compiled_codes
from larql.kv.turbo_quant.kernel_batch import BatchedKernelStep
from larql.kv.turbo_quant.kernel_path import KernelPath
from larql.kv.turbo_quant.rotation import rotation_matrix
from larql.kv.turbo_quant.store import KvLayout, QuantisedLayer, rotate
from larql.models.model import Model

CodecFactory = Callable[[int], RowCodec]  # head_dim → codec


class TurboQuantEngine(KvEngine):
    name = "turbo-quant"

    def __init__(
        self,
        bits: int = 4,
        profiling: bool = False,
        codec_factory: CodecFactory | None = None,
        rotated_attention: bool = True,
        attention: str = "auto",
        use_graph: bool = True,
        k_bits: int | None = None,
        v_bits: int | None = None,
        recent: int = 0,
        sinks: int = 0,
        norm_correction: bool = False,
        center: bool = False,
        recent_bits: int = 16,
    ) -> None:
        """The constructor's defaults are the plain codec; the catalog's (`turbo-quant` with no
        parameter) are what measurement chose."""
        super().__init__(profiling)
        self.bits = bits
        self.k_bits = bits if k_bits is None else k_bits
        self.v_bits = bits if v_bits is None else v_bits
        self.recent, self.sinks, self.recent_bits = recent, sinks, recent_bits
        self.norm_correction, self.center = norm_correction, center
        self.rotated_attention = rotated_attention  # False: decode every row (the reference)
        # auto: the kernels where they run, with the CUDA C++ partial launch where it covers a
        # layer; triton: the Triton launches alone; sdpa: the torch path
        self.attention = attention
        self.use_graph = use_graph  # with the kernels on CUDA: capture the step in a CUDA graph
        self._codec_factory = codec_factory
        self._layout: KvLayout | None = None  # the first layer's (the kernel path's: every layer's)
        self._layouts: list[KvLayout] = []  # each layer's (its head width's codec)
        self._layers: list[QuantisedLayer] | None = None  # the torch path's state
        self._fast: KernelPath | None = None  # the state and step where the kernels run
        self._prompt: PassInParts | None = None  # a prompt part-way in (`prefill_part`)

    # ------------------------------------------------------------------ description

    def codes_label(self) -> str:
        """What the codes are (`describe` adds the path that attends them)."""
        levers = []
        if self.recent or self.sinks:
            levers.append(exact_rows_label(self.sinks, self.recent, self.recent_bits))
        levers += ["norm-corrected"] if self.norm_correction else []
        levers += ["centered"] if self.center else []
        extra = f" ({'; '.join(levers)})" if levers else ""
        return f"{self._bits_label()} WHT+Lloyd-Max K/V{extra}"

    def describe(self) -> str:
        return f"{self.codes_label()}, {self._path()}"

    def config(self) -> str:
        parts = [f"bits={self.bits}"]
        if (self.k_bits, self.v_bits) != (self.bits, self.bits):
            parts.append(f"k_bits={self.k_bits},v_bits={self.v_bits}")
        levers = {
            "recent": self.recent,
            "sinks": self.sinks,
            "norm": int(self.norm_correction),
            "center": int(self.center),
        }
        parts += [f"{name}={value}" for name, value in levers.items() if value]
        if self.recent and self.recent_bits != 16:
            parts.append(f"recent_bits={self.recent_bits}")
        return ",".join(parts)

    def _bits_label(self) -> str:
        if self.k_bits == self.v_bits:
            return f"{self.k_bits}-bit"
        return f"{self.k_bits}/{self.v_bits}-bit (K/V)"

    def memory(self) -> MemoryBreakdown:
        if self._fast is not None:
            return self._fast.memory()
        total = MemoryBreakdown()
        for layer in self._layers or []:
            total = total + layer.memory()
        return total

    def stored_rows(self, layer: int) -> int:
        """Tokens whose K/V layer `layer` holds (encoded or exact)."""
        if self._fast is not None:
            return self._fast.stored_rows(layer)
        return len(self._layers[layer]) if self._layers else 0

    def stored_codes(self, layer: int) -> torch.Tensor:
        """The layer's encoded rows, oldest first, whichever path holds them: uint8
        [n, row_bytes], one row per token ([K heads ; V heads], a codec vector each)."""
        if self._fast is not None:
            return self._fast.codes_in_token_order(layer)
        if not self._layers:
            raise InvariantViolation("no codes stored before prefill")
        return self._layers[layer].codes.rows

    def dispatch_path(self) -> str | None:
        if self._fast is None:
            return None
        return "cuda-graph" if self._fast.captured else "static"

    def supports_multimodal(self) -> bool:
        return True

    def prompt_part_way(self) -> bool:
        return self._prompt is not None

    def fork_prefix(self, model: Model, tokens: int) -> Engine | None:
        """Every layer's rows of the first `tokens` tokens as this engine keeps them: rows
        coded over the longer context stay coded, and the mean a centred codec subtracts
        stays the longer prompt's (what it kept of them, not a fresh prefill). On the kernel
        path, whose newest rows are exact, the newest coded ones go back among them decoded
        (`QuantisedLayer.uncode_newest`): the values their codes hold."""
        if tokens == self.position or not 0 < tokens < self.position:
            return super().fork_prefix(model, tokens)
        if any(shares(model.config, layer) for layer in range(model.config.num_layers)):
            return None
        if self._fast is not None:
            return self._fork_prefix_on_kernels(model, tokens)
        clone = super().fork_prefix(model, self.position)
        if not isinstance(clone, TurboQuantEngine) or clone._layers is None:
            return None
        if not all(layer.cut_back(tokens) for layer in clone._layers):
            return None
        clone.position = tokens
        return clone

    def _fork_prefix_on_kernels(self, model: Model, tokens: int) -> Engine | None:
        """`fork_prefix` of a kernel-path engine: its state read into the torch path's stores,
        cut back, its newest rows made exact again, then forked onto the kernel path."""
        if not self._forkable():
            return None
        whole = declared_state(self, keep_device=True)
        reader = StateReader(whole.fields, whole.tensors, model.device)
        stores = self._torch_layers(model, self._prepare_layouts(model))
        prefix = StateWriter(keep_device=True)
        for layer, store in enumerate(stores):
            store.read_state(reader.scope(f"layers.{layer}"), self.position)
            if not store.cut_back(tokens):
                return None
            store.uncode_newest()
            store.write_state(prefix.scope(f"layers.{layer}"))
        return self._fork_holding(model, prefix, tokens)

    def write_state(self, state: StateWriter) -> None:
        """Each layer's stored rows (`layers.N.*`: sinks, codes, recent rows, mean), in one
        form whichever path holds them."""
        if self._fast is not None:
            for layer in range(len(self._fast.layers)):
                self._fast.write_layer_state(layer, state.scope(f"layers.{layer}"))
            return
        for layer, store in enumerate(self._layers or []):
            store.write_state(state.scope(f"layers.{layer}"))

    def read_state(self, state: StateReader, model: Model) -> None:
        """Every layer's rows of `position` tokens (none on a layer that shares another's
        K/V), then onto the kernel path where its kernels run and the rows are laid out as
        it lays them out (`on_kernel_path`)."""
        keeps = self._prepare_layouts(model)
        self._fast, self._prompt = None, None
        self._layers = self._torch_layers(model, keeps)
        for layer, store in enumerate(self._layers):
            held = 0 if shares(model.config, layer) else self.position
            store.read_state(state.scope(f"layers.{layer}"), held)
        self._fast = on_kernel_path(
            self._kernel_path(model, keeps), model, self.position, self._layers
        )
        if self._fast is not None:
            self._layers = None

    # ------------------------------------------------------------------ prefill

    def _start(
        self, model: Model, ffn: FfnBackend, rows: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """rows: [S, H] → every row's hidden [S, H], attending over exact K/V."""
        cfg = model.config
        keeps = self._new_stores(model, rows.shape[0])
        if (
            self._fast is None
            and (h := self._prompt_in_one_call(model, ffn, rows, inputs, keeps)) is not None
        ):
            return h
        h = rows  # [S, H]
        shared = SharedKv(cfg)  # a K/V-sharing layer's store stays empty
        for layer in range(cfg.num_layers):
            exact = FreshKv()
            h = attention_block(model, layer, h, 0, exact, shared=shared)
            if shares(cfg, layer):
                h = ffn_block(model, layer, h, ffn, inputs)
                continue
            assert exact.k is not None and exact.v is not None
            if self._fast is not None:
                self._fast.store_prompt(layer, exact.k, exact.v)
            else:
                assert self._layers is not None
                self._layers[layer].append(exact.k, exact.v)
            h = ffn_block(model, layer, h, ffn, inputs)
        return h

    def _prepare_layouts(self, model: Model) -> list[int | None]:
        """Each layer's layout (a codec of its head width: Gemma 4's global layers are wider)
        → the rows each layer keeps (None: every row)."""
        cfg = model.config
        widths = {cfg.head_dim_of(layer) for layer in range(cfg.num_layers)}
        by_width = {width: self._kv_layout(width) for width in sorted(widths)}
        self._layouts = [by_width[cfg.head_dim_of(layer)] for layer in range(cfg.num_layers)]
        self._layout = self._layouts[0]
        return [self._keep(model, layer) for layer in range(cfg.num_layers)]

    def _torch_layers(self, model: Model, keeps: list[int | None]) -> list[QuantisedLayer]:
        """The torch path's empty layer stores."""
        return [
            QuantisedLayer(
                self._layouts[layer],
                keep,
                model.config.kv_heads_of(layer),
                model.dtype,
                compiled=self._compiled(model, self._layouts[layer]),
            )
            for layer, keep in enumerate(keeps)
        ]

    def _new_stores(self, model: Model, prompt_tokens: int) -> list[int | None]:
        """Empty stores for a prompt of `prompt_tokens` tokens: the torch path's layers, or the
        kernel path → the rows each layer keeps."""
        keeps = self._prepare_layouts(model)
        self._fast = self._kernel_path(model, keeps)
        self._layers = None if self._fast is not None else self._torch_layers(model, keeps)
        if self._fast is not None:
            self._fast.start(model, prompt_tokens)
        return keeps

    def takes_prompt_in_parts(self, model: Model) -> bool:
        """On the torch path (where the kernels run, their step is sized from the prompt)."""
        kernels = larql.kernels.triton_available(model.device) and self.attention != "sdpa"
        return not kernels or not self._kernels_for_codec()

    def prefill_part(
        self, model: Model, ffn: FfnBackend, token_ids: Sequence[int], more: bool
    ) -> torch.Tensor:
        """The prompt through one pass over its exact K/V, a part at a time (`PassInParts`);
        once it is whole, its K/V go into the stores as one whole prefill puts them, a layer
        at a time (`finish_prompt`) → the part's rows [n, H]."""
        if self._prompt is None:
            if len(token_ids) == 0:
                raise EmptyPrompt()
            self._check_ffn(ffn)
            self._backend = backend_name(model)
            self._prompt = PassInParts(model)
        rows = self._prompt.run(model, ffn, token_tensor(model, list(token_ids)))
        self.position = self._prompt.length
        if more:
            return rows
        prompt, self._prompt = self._prompt, None
        self._new_stores(model, prompt.length)
        self._finishing = [
            partial(self._store_prompt_layer, layer, exact)
            for layer, exact in enumerate(prompt.layers)
            if not shares(model.config, layer)
        ]
        self._started(prompt.length)
        return rows

    def _store_prompt_layer(self, layer: int, exact: KvBuffer) -> int:
        """A whole prompt's exact K/V of one layer into its store (coded) → the rows."""
        if self._fast is not None:
            self._fast.store_prompt(layer, exact.keys, exact.values)
        else:
            assert self._layers is not None
            self._layers[layer].append(exact.keys, exact.values)  # [Hkv, S, D] each
        return len(exact)

    def _prompt_in_one_call(
        self,
        model: Model,
        ffn: FfnBackend,
        rows: torch.Tensor,
        inputs: torch.Tensor | None,
        keeps: list[int | None],
    ) -> torch.Tensor | None:
        """The prompt rows [S, H] through `standard`'s one compiled call for a new prompt (its
        exact K/V into float buffers, then each layer's rows into its store, coded where they
        leave the exact rows) → every row's hidden [S, H]; None where the call does not take
        them (the layer-by-layer prefill then runs)."""
        if inputs is None and not model.config.shares_kv and all(k is None for k in keeps):
            buffers = [KvBuffer() for _ in keeps]
            h = prompt_in_one_call(model, ffn, rows, buffers)
            if h is not None:
                assert self._layers is not None
                for store, buffer in zip(self._layers, buffers, strict=True):
                    store.append(buffer.keys, buffer.values)  # [Hkv, S, D] each
                return h
        return None

    # ------------------------------------------------------------------ decode

    def _step_token(self, model: Model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        if self._fast is not None:  # the kernel path embeds on the device (a captured graph)
            return self._fast.decode(model, ffn, self.position, token_id=token_id)
        return super()._step_token(model, ffn, token_id)

    def _step(
        self, model: Model, ffn: FfnBackend, row: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        if self._fast is not None:
            return self._fast.decode(model, ffn, self.position, hidden=row)
        return self._decode_layers(model, ffn, row, inputs)

    def _decode_layers(
        self, model: Model, ffn: FfnBackend, h: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """h: [1, H] at `self.position` (per-layer inputs [1, L, P] or None) → [1, H] after
        every layer; stores the new row."""
        assert self._layers is not None
        if inputs is None and (fused := coded_layers_step([self], model, ffn, h)) is not None:
            return fused  # every layer in one compiled call
        stage, device = self._profiler.stage, model.device
        shared = SharedKv(model.config)
        for layer, store in enumerate(self._layers):
            rotation = self._rotation(device, layer)
            if shares(model.config, layer):  # its source's rows, in the same basis
                q = project_q(model, layer, h, self.position)  # [Hq, 1, D]
                keys, values, _ = shared.of(layer)
                attn = self._attend_in_basis(model, layer, q, keys, values, rotation)
            else:
                q, k, v = project_qkv(model, layer, h, self.position)  # [Hq|Hkv, 1, D]
                attn = self._attend_and_share(model, layer, q, k, v, rotation, shared)
                with stage("state_append", device):
                    store.append(k, v)
            with stage("attention", device):
                h = attention_output(model, layer, h, attn)  # attn: [1, q_dim]
            with stage("ffn", device):
                h = ffn_block(model, layer, h, ffn, inputs)
        return h

    def _attend_and_share(
        self,
        model: Model,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotation: torch.Tensor | None,
        shared: SharedKv,
    ) -> torch.Tensor:
        """The decode query q [Hq, 1, D] over the layer's stored rows and the new row k, v
        [Hkv, 1, D] → [1, q_dim]: over the codes in place on the CPU where `coded_cpu` applies
        (not with `attention=sdpa`), else over the history made whole (kept in `shared` for the
        layers that share it)."""
        in_place = self._attend_in_place(model, layer, q, k, v, rotation, shared)
        if in_place is not None:
            return in_place
        keys, values = self._history_with_row(model, layer, k, v, rotation)
        shared.keep(layer, keys, values)
        return self._attend_in_basis(model, layer, q, keys, values, rotation)

    def _attend_in_place(
        self,
        model: Model,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotation: torch.Tensor | None,
        shared: SharedKv,
    ) -> torch.Tensor | None:
        """`_attend_and_share`'s attention over the stored codes in the CPU extension (`coded_cpu`)
        → [1, q_dim], or None where it does not apply."""
        assert self._layers is not None
        store = self._layers[layer]
        in_place = codes_in_place(model, layer, store, rotation, shared)
        kernels = cpu_extension() if in_place else None
        if kernels is None or rotation is None:
            return None
        with self._profiler.stage("attention", model.device):
            return attend_coded(kernels, model, layer, store, q, k, v, rotation)

    def _history_with_row(
        self,
        model: Model,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        rotation: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's stored rows then the new row k, v [Hkv, 1, D], decoded (`rotation`
        None) or in the rotated basis → keys, values [Hkv, n + 1, D']."""
        assert self._layers is not None
        stage, device, dtype = self._profiler.stage, model.device, model.dtype
        with stage("state_materialise", device):
            keys, values = self._layers[layer].keys_values(dtype, rotation)  # [Hkv, n, D']
            if rotation is not None:
                k, v = rotate(k, rotation).to(dtype), rotate(v, rotation).to(dtype)
            return torch.cat((keys, k), dim=1), torch.cat((values, v), dim=1)

    def _attend_in_basis(
        self,
        model: Model,
        layer: int,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        rotation: torch.Tensor | None,
    ) -> torch.Tensor:
        """q [Hq, 1, D] at `self.position` over keys, values [Hkv, n, D'] in the basis
        `rotation` gives (None: the model's own) → [1, q_dim]."""
        with self._profiler.stage("attention", model.device):
            if rotation is None:
                return attend(model, layer, q, keys, values, self.position, None)
            cfg, dtype = model.config, model.dtype
            q_rot = rotate(q, rotation).to(dtype)
            attn = attend(model, layer, q_rot, keys, values, self.position, None)  # [1, Hq·D']
            back = attn.view(cfg.num_heads, -1).float() @ rotation  # [Hq, D'] (R·R = I)
            return back[:, : cfg.head_dim_of(layer)].to(dtype).reshape(1, cfg.q_dim_of(layer))

    # ------------------------------------------------------------------ batched decode

    def batch_key(self) -> Hashable | None:
        """Engines of one configuration and path batch: the torch-path ones together, the
        kernel-path ones together (graph or eager)."""
        if self._fast is not None:
            fast = self._fast
            return (type(self), "kernels", self.config(), fast.use_graph, fast.partial_in_cuda)
        if self._layers is None:
            return None
        return (type(self), self.config(), self.rotated_attention, self._codec_factory is None)

    @classmethod
    def _step_batch(
        cls,
        engines: Sequence[Engine],
        model: Model,
        ffn: FfnBackend,
        rows: torch.Tensor,
        inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        """rows: [B, H] → [B, H]: projections and FFN once for all rows. Kernel-path engines:
        `BatchedKernelStep` (each layer's attention and encoding in three launches for every
        session; on CUDA a captured graph per batch size). Torch-path ones: each row attending
        over its own engine's stored rows; each engine then stores its new row."""
        paths = [e._fast for e in engines if isinstance(e, TurboQuantEngine)]
        if paths and all(path is not None for path in paths):
            kernel_paths = [path for path in paths if path is not None]
            step = BatchedKernelStep.of(model, engines[0].batch_key(), kernel_paths[0])
            positions = [e.position for e in engines]
            return step.step(model, ffn, kernel_paths, positions, rows)
        batch = [e for e in engines if isinstance(e, TurboQuantEngine) and e._layers is not None]
        assert len(batch) == len(engines), "batch_key groups only torch-path engines"
        if inputs is None and (fused := coded_layers_step(batch, model, ffn, rows)) is not None:
            return fused  # every layer of every session in one compiled call
        positions = [e.position for e in batch]
        shared = [SharedKv(model.config) for _ in batch]  # each session's, for sharing layers
        isolated = IsolatedRows()  # each engine's attention: its failure fails it alone
        h = rows
        for layer in range(model.config.num_layers):
            rotation = batch[0]._rotation(model.device, layer)
            new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            rows_attend = partial(_attend_and_keep, batch, model, layer, rotation, new, shared)
            h = batched_layer_step(model, layer, h, positions, isolated(rows_attend), ffn, inputs)
            for i, (k, v) in new.items():  # none on a sharing layer
                if i not in isolated.failures:
                    batch[i]._layers[layer].append(k, v)  # type: ignore[index]
        return isolated.check(h)

    def withdraws_steps(self) -> bool:
        """On the kernel path a step writes its row into the exact ring's slot of a row already
        coded (the ring has one slot more than the exact rows) and codes the row leaving the
        ring into the slot after the coded ones: with the position moved back, neither slot is
        read, and stepping again writes both anew."""
        return self._fast is not None

    def withdraw_step(self) -> None:
        if self._fast is None:
            super().withdraw_step()
        self._require_prefill()
        self.position -= 1
        assert self._fast is not None
        self._fast.position -= 1

    def _kernels_for_codec(self) -> bool:
        """Whether this engine's codec has Triton kernels (`_triton_kernels`): the TurboQuant
        codec attending in its rotated basis."""
        return self.rotated_attention and self._codec_factory is None

    def _triton_kernels(self) -> ModuleType:
        """The module of the codec's Triton launches (imports Triton: only where it runs)."""
        from larql.kv.turbo_quant import kernels

        return kernels

    def kernels_taking(self, model: Model, keeps: list[int | None]) -> ModuleType | None:
        """The module of the Triton launches that would run this engine's step on `model` (the
        layouts prepared: `_prepare_layouts` → `keeps`): when asked (auto/triton), where they
        run, for a codec that has them (`_kernels_for_codec`) and a layout they take; else
        None (the torch path)."""
        if self.attention == "sdpa" or not self._kernels_for_codec():
            return None
        if model.config.arch.attention_sinks:  # the kernels have no attention sinks
            return None
        if model.weights.per_layer is not None or model.config.shares_kv:
            return None  # its captured step has neither per-layer inputs nor shared K/V
        if not model.config.uniform_attention:  # the kernels keep one codec for every layer
            return None
        if not larql.kernels.triton_available(model.device):
            return None
        kernels = self._triton_kernels()
        assert self._layout is not None
        return kernels if KernelPath.supports(kernels, self._layout, keeps) else None

    def _kernel_path(self, model: Model, keeps: list[int | None]) -> KernelPath | None:
        """The Triton kernels' path where they take this engine on `model` (`kernels_taking`);
        else None (the torch path)."""
        kernels = self.kernels_taking(model, keeps)
        if kernels is None:
            return None
        assert self._layout is not None
        return KernelPath(
            kernels,
            self._layout,
            model,
            keeps,
            self.use_graph,
            self._profiler,
            use_cuda_partial=self.attention == "auto",
        )

    def _compiled(self, model: Model, layout: KvLayout) -> bool:
        """Whether a layer of this layout is encoded and attended by the CPU extension: for the
        rotated-basis attention with the default codec, not the torch reference (`sdpa`)."""
        if self.attention == "sdpa" or not self.rotated_attention or self._codec_factory:
            return False
        return compiled_codes(model, layout.k_codec, layout.v_codec)

    def _kv_layout(self, head_dim: int) -> KvLayout:
        def codec(bits: int) -> RowCodec:
            if self._codec_factory is not None:
                return self._codec_factory(head_dim)
            return TurboQuantCodec(head_dim, bits, self.norm_correction)

        k_codec = codec(self.k_bits)
        # one codec for both where they agree: the store then encodes and decodes K and V rows
        # in one call each (a decode step's leaving row cost two calls' torch overhead)
        v_codec = k_codec if self.v_bits == self.k_bits else codec(self.v_bits)
        return KvLayout(k_codec, v_codec, self.sinks, self.recent, self.center, self.recent_bits)

    def _path(self) -> str:
        if self._fast is not None:
            return kernel_path_label(self._fast)
        return "rotated-basis attention" if self.rotated_attention else "decoded attention"

    def _rotation(self, device: torch.device, layer: int) -> torch.Tensor | None:
        """Layer `layer`'s R [D', D'] float32 when the step attends in the codec's rotated
        basis, else None."""
        codec = self._layouts[layer].k_codec if self._layouts else None
        if not (self.rotated_attention and isinstance(codec, TurboQuantCodec)):
            return None
        return rotation_matrix(codec.rotated_dim, torch.float32, device)

    @staticmethod
    def _keep(model: Model, layer: int) -> int | None:
        return kept_rows(effective_window(model, layer, None))


def kernel_path_label(fast: KernelPath) -> str:
    """What `describe` says of a step on the Triton kernels."""
    graph = ", cuda-graph step" if fast.captured else ""
    cuda = " with the CUDA C++ partial launch" if fast.partial_in_cuda else ""
    return f"triton kernels{cuda}{graph}"


def exact_rows_label(sinks: int, recent: int, recent_bits: int) -> str:
    """What `describe` says of the rows kept out of the codes."""
    if recent_bits == 16:
        return f"{sinks} sink + {recent} recent rows exact at 16 bits"
    return f"{sinks} sink rows exact at 16 bits + {recent} recent rows at int8"


def _attend_and_keep(
    batch: list[TurboQuantEngine],
    model: Model,
    layer: int,
    rotation: torch.Tensor | None,
    new: dict[int, tuple[torch.Tensor, torch.Tensor]],
    shared: list[SharedKv],
    i: int,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
) -> torch.Tensor:
    """Row i of a batched step: engine i's attention; its new row kept (in `new`, by row) for
    storing after the layer. A K/V-sharing layer's row attends over what its
    source attended over, and keeps nothing."""
    engine = batch[i]
    if k is None or v is None:
        keys, values, _ = shared[i].of(layer)
        return engine._attend_in_basis(model, layer, q, keys, values, rotation)  # [1, q_dim]
    new[i] = (k, v)
    return engine._attend_and_share(model, layer, q, k, v, rotation, shared[i])


def on_kernel_path(
    path: KernelPath | None,
    model: Model,
    position: int,
    stores: list[QuantisedLayer],
    rows: list[int] | None = None,
) -> KernelPath | None:
    """Torch-path stores read back from a saved state (`rows[i]` rows in store i; None: the
    position in each) → `path` holding them, or None where there is no path or a store is not
    laid out as the path lays out its rows (then the stores stay the engine's)."""
    if path is None:
        return None
    path.start(model, position, rows)
    if not all(path.take_layer(layer, store) for layer, store in enumerate(stores)):
        return None
    return path
