"""`kvzip`: keep the rows the model needs to reconstruct its context. After the prefill the
model reads a "repeat the context" instruction followed by the context again, each of those
positions attending over the prompt's exact cached K/V and the reconstruction's own; a prompt
row's score, per layer and K/V head, is the most any reconstruction query (of any query head of
the group) attends to it. Rows nothing needs to rebuild the context are the ones it can lose,
whatever question comes later: query-agnostic by construction.

The reconstruction is a second forward pass over about as many positions as the prompt (the
instruction's few more), attending over twice the prompt's rows, in `RECONSTRUCTION_CHUNK`-position
chunks: the prefill then costs about 3× `standard`'s. A scored layer's attention weights are
computed once, in float32, for both its output and the rows' scores (`attended_with_peak`). Its
K/V are dropped after scoring.
A prompt is therefore taken whole (not in parts): its rows are needed again at the end."""

from __future__ import annotations

import torch

from larql.inference.ffn import FfnBackend
from larql.inference.layer import (
    attention_output,
    embed_rows,
    ffn_block,
    layer_step,
    project_qkv,
    token_tensor,
)
from larql.inference.shared_kv import SharedKv, shares
from larql.kv.buffers import KvBuffer
from larql.kv.eviction.budget import Budget
from larql.kv.eviction.ragged import RaggedRows
from larql.kv.eviction.scores import attended_with_peak
from larql.kv.eviction.scoring import ScoringEngine
from larql.models.model import Model

INSTRUCTION = "\n\nRepeat the previous context exactly.\n"
RECONSTRUCTION_CHUNK = 512  # reconstruction positions per pass through the layers


class KvZipEngine(ScoringEngine):
    name = "kvzip"
    across_layers = True  # every layer scored before any is cut: layers=adaptive applies

    def __init__(self, budget: Budget, profiling: bool = False) -> None:
        super().__init__(budget, profiling)

    def scorer(self) -> str:
        return "the rows the model attends to most while reconstructing the context"

    def takes_prompt_in_parts(self, model: Model) -> bool:
        return False  # the reconstruction re-reads the whole prompt's rows at its end

    def _row_scores(
        self, model: Model, layer: int, held: object, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        assert isinstance(held, torch.Tensor)
        return held  # the reconstruction's (`_reconstruction_scores`)

    def _start(
        self, model: Model, ffn: FfnBackend, rows: torch.Tensor, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """rows: [S, H] → every prompt row's hidden [S, H]: the exact prefill, the
        reconstruction pass over its K/V, then each layer keeps its best-scored rows."""
        exact = [KvBuffer() for _ in range(model.config.num_layers)]
        shared = SharedKv(model.config)
        h = rows
        for layer, kv in enumerate(exact):
            h = layer_step(model, layer, h, 0, kv, ffn, inputs=inputs, shared=shared)
        scores = self._reconstruction_scores(model, ffn, exact, rows, inputs)
        self._layers = []
        across = self._across_layers(model, exact, scores)
        for layer, (kv, score) in enumerate(zip(exact, scores, strict=True)):
            if across[layer] is None:
                self._keep_prompt_layer(model, layer, kv, score)
            else:
                self._layers.append(self._kept(model, layer, across[layer]))
        self._settle(model, rows.shape[0])
        return h

    def _across_layers(
        self, model: Model, exact: list[KvBuffer], scores: list[torch.Tensor | None]
    ) -> list[RaggedRows | None]:
        """`layers=adaptive`: each scored layer's rows picked across every layer and head
        (`Budget.across_layers`), packed per head; None where a layer keeps its own way (not
        scored, the schedule is another, or the budget holds the whole prompt)."""
        # a layer whose K/V a later layer reads keeps every head alike (`_adaptive`)
        scored = [
            layer
            for layer, score in enumerate(scores)
            if score is not None and not SharedKv(model.config).is_source(layer)
        ]
        across: list[RaggedRows | None] = [None] * len(scores)
        if self.budget.layers != "adaptive" or not scored:
            return across
        t = len(exact[scored[0]])
        count = self.budget.per_head(t)
        if count >= t:
            return across
        chosen = [scores[layer] for layer in scored]
        if chosen[0].device.type == "meta":  # `larql memory`: the same rows in all, packed
            heads = chosen[0].shape[0]
            even = torch.arange(heads)[:, None] * t + torch.arange(count)[None, :]
            picked = [even.reshape(-1).to(score.device) for score in chosen]
        else:
            picked = self.budget.across_layers(chosen, count)
        for layer, flat in zip(scored, picked, strict=True):
            kv = exact[layer]
            across[layer] = RaggedRows.picked(kv.keys, kv.values, flat // t, flat % t)
        return across

    def _reconstruction_scores(
        self,
        model: Model,
        ffn: FfnBackend,
        exact: list[KvBuffer],
        rows: torch.Tensor,
        inputs: torch.Tensor | None,
    ) -> list[torch.Tensor | None]:
        """The instruction and the context rows [S, H] again, after the prompt's exact K/V
        `exact` (left as they were) → per layer, each prompt row's peak attention [Hkv, S]
        (None on a layer that keeps a window or shares another's K/V)."""
        cfg = model.config
        prompt = rows.shape[0]
        ids = token_tensor(model, model.tokenizer.encode(INSTRUCTION))
        head, head_inputs = embed_rows(model, ids)  # [I, H], [I, L, P] or None
        queries = torch.cat((head, rows))  # [I + S, H]
        query_inputs = None if inputs is None else torch.cat((head_inputs, inputs))
        scored = [
            not shares(cfg, layer)
            and cfg.layers[layer].sliding_window is None
            and model.weights.layers[layer].attn_sinks is None
            for layer in range(cfg.num_layers)
        ]
        peak: list[torch.Tensor | None] = [None] * cfg.num_layers
        # on meta (`larql memory`) nothing is allocated: one pass holds the same rows in the
        # end and dispatches a chunk's ops once instead of once per chunk
        chunk = queries.shape[0] if queries.device.type == "meta" else RECONSTRUCTION_CHUNK
        for first in range(0, queries.shape[0], chunk):
            h = queries[first : first + chunk]
            part = None if query_inputs is None else query_inputs[first : first + h.shape[0]]
            start = prompt + first
            shared = SharedKv(cfg)
            for layer, kv in enumerate(exact):
                if not scored[layer]:
                    h = layer_step(model, layer, h, start, kv, ffn, inputs=part, shared=shared)
                    continue
                h, seen = _scored_layer(model, layer, h, start, kv, prompt, shared)  # [Hkv, S]
                h = ffn_block(model, layer, h, ffn, part)
                held = peak[layer]
                peak[layer] = seen if held is None else torch.maximum(held, seen)
        for kv in exact:
            if len(kv):  # (a layer sharing another's K/V holds none)
                kv.truncate(prompt)
        return peak


def _scored_layer(
    model: Model,
    layer: int,
    h: torch.Tensor,
    start: int,
    kv: KvBuffer,
    prompt: int,
    shared: SharedKv,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_block` for reconstruction rows h [n, H] at positions start.. whose K/V go
    into `kv`, reading the attention weights it computes → (the residual after attention
    [n, H], each of the first `prompt` rows' peak weight [Hkv, prompt])."""
    q, k, v = project_qkv(model, layer, h, start)
    keys, values = kv.append(k, v)
    shared.keep(layer, keys, values)
    attn, peak = attended_with_peak(model, q, keys, values, start, prompt)  # [n, q_dim]
    return attention_output(model, layer, h, attn), peak
