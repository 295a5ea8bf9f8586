"""`apollo`: a retrieval engine. Instead of keeping K/V it routes the query to a window of a
prebuilt store, injects the embeddings of that window's fact tokens into the residual stream,
and re-runs the forward pass every step.

Prefill:
1. route: the best window of `WindowRouter.resolve(query, 3)` (none ⇒ `RetrievalMiss`);
2. retrieve: `retrieve_entries` within that window;
3. delta [H] = Σ over retrieved entries whose token is not in the query of
   embed(token) × entry.coefficient × coef (embedding scale included);
4. forward, and right after layer `injection_layer` add delta to the last row:
   - compressed (the store keeps a boundary for the window): rows [boundary ; embed(query)] at
     positions 0, 1, … run through layers crystal..L−1 only. The boundary is the pre-layer
     residual entering layer `crystal` (see `store.py`), so it stands in, as a virtual position
     0, for the whole window;
   - uncompressed: a full forward over the window's tokens ++ the query.
   A query's leading BOS is dropped in both cases (it would sit mid-context).

Decode appends the token to the context and redoes the same forward (O(N²) by design, no K/V).
The engine takes no FFN backend (it is a `RetrievalEngine`); it computes with the model's own.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from larql.inference.engine import RetrievalEngine
from larql.inference.errors import RetrievalMiss
from larql.inference.ffn import DenseFfn, FfnBackend
from larql.inference.forward import run_layers
from larql.inference.layer import embed, embed_rows, token_tensor
from larql.inference.memory import MemoryBreakdown, tensor_bytes
from larql.kv.apollo.builder import build_store
from larql.kv.apollo.retrieval import ScoredEntry, retrieve_entries
from larql.kv.apollo.routing import WindowRouter
from larql.kv.apollo.store import ApolloStore
from larql.kv.spec import EngineBuildError
from larql.models.model import Model

DEFAULT_COEF = 10.0
DEFAULT_TOP_K = 8
ROUTE_CANDIDATES = 3


@dataclass(frozen=True)
class Injection:
    """What prefill retrieved: the routed window, its entries and the delta they make."""

    window: int
    window_score: float
    entries: tuple[ScoredEntry, ...]
    injected_tokens: tuple[int, ...]  # retrieved tokens not in the query (they make the delta)
    delta: torch.Tensor  # [H], model dtype
    boundary: torch.Tensor | None  # [1, H], model dtype; None = uncompressed


class ApolloEngine(RetrievalEngine):
    name = "apollo"

    def __init__(
        self,
        store: ApolloStore | None = None,
        injection_layer: int | None = None,
        inject_coefficient: float = DEFAULT_COEF,
        top_k: int = DEFAULT_TOP_K,
        model: Model | None = None,
        bos: int | None = None,
    ) -> None:
        """`bos`: the id dropped from the front of a query (None: the model's BOS)."""
        super().__init__()
        self.bos = bos
        self.store = store
        self._layer_param = injection_layer  # None ⇒ the store's arch_config.injection_layer
        self.inject_coefficient = inject_coefficient
        self.top_k = top_k
        self._backend = model.device.type if model is not None else "cpu"
        self._router: WindowRouter | None = None
        self._context: torch.Tensor | None = None  # [T] int32: query (+ window tokens)
        self.injection: Injection | None = None
        self._warned_skip = False
        if model is not None:
            self._check_model(model)

    # ------------------------------------------------------------------ description

    @property
    def injection_layer(self) -> int | None:
        if self._layer_param is not None:
            return self._layer_param
        return self.store.manifest.arch_config.injection_layer if self.store else None

    @property
    def compressed(self) -> bool:
        return self.store is not None and (
            self.store.boundaries is not None or self.store.boundary_residual is not None
        )

    def describe(self) -> str:
        if self.store is None:
            return "retrieval+injection: no store attached (apollo:store=DIR)"
        m = self.store.manifest
        mode = f"compressed(layer={m.crystal_layer})" if self.compressed else "uncompressed"
        return f"retrieval+injection [{mode}]: {m.num_windows} windows, {m.num_entries} entries"

    def config(self) -> str:
        layer = "store" if self.injection_layer is None else self.injection_layer
        bos = "" if self.bos is None else f",bos={self.bos}"
        return f"inject_layer={layer},coef={self.inject_coefficient},top_k={self.top_k}{bos}"

    def memory(self) -> MemoryBreakdown:
        """hot: the store and the context ids; derivative: delta and boundary copies."""
        store = self.store.total_bytes() if self.store is not None else 0
        derived = 0
        if self.injection is not None:
            derived = tensor_bytes(self.injection.delta, self.injection.boundary)
        return MemoryBreakdown(hot=store + tensor_bytes(self._context), derivative=derived)

    def index_context(self, model: Model, text: str) -> None:
        """A store built from `text` with `larql apollo build-store`'s defaults replaces the
        attached one: the long-context suite's context becomes what apollo retrieves from."""
        self.store = build_store(model, text)
        self._router = None
        self.injection = None
        self._check_model(model)

    # ------------------------------------------------------------------ protocol

    def _start_tokens(self, model: Model, ffn: FfnBackend, token_ids: list[int]) -> torch.Tensor:
        """The FFN handed in is not used: apollo computes with the model's own."""
        if self.store is None:
            raise RetrievalMiss("apollo store not attached")
        self._check_model(model)
        query = [int(t) for t in token_ids]
        self.injection = self._prepare_injection(model, query)
        body = _drop_leading_bos(
            query, self.bos if self.bos is not None else model.config.bos_token_id
        )
        if self.injection.boundary is None:
            body = [int(t) for t in self.store.window_tokens[self.injection.window]] + body
        self._context = torch.tensor(body, dtype=torch.int32, device=model.device)
        return self._forward(model)

    def _step_token(self, model: Model, ffn: FfnBackend, token_id: int) -> torch.Tensor:
        assert self._context is not None
        new = torch.tensor([token_id], dtype=torch.int32, device=self._context.device)
        self._context = torch.cat([self._context, new])
        return self._forward(model)

    # ------------------------------------------------------------------ steps

    def _check_model(self, model: Model) -> None:
        depth = model.config.num_layers
        if self.store is not None:
            self.store.check_model(model.name, model.config.hidden_size, depth)
        layer = self.injection_layer
        if layer is not None and not 0 <= layer < depth:
            raise EngineBuildError(
                f"apollo: injection layer {layer} is outside {model.name}'s layers 0..{depth - 1}"
            )

    @torch.inference_mode()
    def _prepare_injection(self, model: Model, query: list[int]) -> Injection:
        assert self.store is not None
        if self._router is None:
            self._router = WindowRouter(self.store.window_tokens)
        routed = self._router.resolve(query, ROUTE_CANDIDATES)
        if not routed:
            raise RetrievalMiss("no store window matches the query")
        window, score = routed[0]
        entries = retrieve_entries(self.store.entries, query, [window], self.top_k)
        in_query = set(query)
        injected = [e for e in entries if e.token_id not in in_query]
        delta = torch.zeros(model.config.hidden_size, dtype=model.dtype, device=model.device)
        if injected:
            rows = embed(model, token_tensor(model, [e.token_id for e in injected]))  # [E, H]
            weights = torch.tensor(
                [e.coefficient for e in injected], dtype=model.dtype, device=model.device
            )
            delta = (rows * weights[:, None]).sum(0) * self.inject_coefficient  # [H]
        stored = self.store.boundary(window)
        boundary = None
        if stored is not None:
            # a copy in the model's dtype: the engine never writes into the store's arrays
            boundary = torch.tensor(stored, dtype=model.dtype, device=model.device).reshape(1, -1)
            self._warn_if_injection_skipped()
        return Injection(
            window=window,
            window_score=score,
            entries=tuple(entries),
            injected_tokens=tuple(e.token_id for e in injected),
            delta=delta,
            boundary=boundary,
        )

    def _warn_if_injection_skipped(self) -> None:
        assert self.store is not None
        layer, crystal = self.injection_layer, self.store.manifest.crystal_layer
        if layer is not None and layer < crystal and not self._warned_skip:
            self._warned_skip = True
            warnings.warn(
                f"apollo: injection layer {layer} is below the store's crystal layer {crystal}; "
                "the compressed forward starts at the crystal layer, so nothing is injected",
                stacklevel=3,
            )

    def _forward(self, model: Model) -> torch.Tensor:
        assert self.injection is not None and self._context is not None
        delta, at = self.injection.delta, self.injection_layer

        def inject(layer: int, hidden: torch.Tensor) -> torch.Tensor | None:
            if layer != at:
                return None
            return torch.cat([hidden[:-1], hidden[-1:] + delta])  # [S, H]

        with torch.inference_mode():
            ids = self._context.long()
            layers = None
            if self.injection.boundary is not None:
                assert self.store is not None
                # the boundary row stands for its window's last token (its per-layer inputs)
                last = int(self.store.window_tokens[self.injection.window][-1])
                ids = torch.cat([ids.new_tensor([last]), ids])
            h, inputs = embed_rows(model, ids)  # [T, H], [T, L, P] or None
            if self.injection.boundary is not None:
                assert self.store is not None
                h = torch.cat([self.injection.boundary, h[1:]])  # boundary at position 0
                layers = range(self.store.manifest.crystal_layer, model.config.num_layers)
            out = run_layers(
                model, DenseFfn(model), h, 0, layers, after_layer=inject, inputs=inputs
            )
        return out[-1:]


def _drop_leading_bos(query: list[int], bos: int | None) -> list[int]:
    if bos is not None and len(query) > 1 and query[0] == bos:
        return query[1:]
    return query


def build_apollo(
    injection_layer: int | None,
    inject_coefficient: float,
    top_k: int,
    store: str | Path | None,
    model: Model | None,
    bos: int | None = None,
) -> ApolloEngine:
    """The catalog's factory: loads `store=DIR` now, so a bad store fails at build time."""
    loaded = ApolloStore.load(store) if store is not None else None
    if bos is not None and model is not None and not 0 <= bos < model.config.vocab_size:
        top = model.config.vocab_size - 1
        raise EngineBuildError(f"apollo: bos={bos} is outside {model.name}'s vocabulary (0..{top})")
    return ApolloEngine(loaded, injection_layer, inject_coefficient, top_k, model, bos)
