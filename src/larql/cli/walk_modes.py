"""What `larql walk` computes (the command and its rendering are in `walk_cmd`): the features
firing at the last position, dense vs walk next-token distributions, generation through the
walk FFN."""

from __future__ import annotations

import sys
from typing import Any

import torch

from larql.cli.common import stderr
from larql.inference.decode_path import decode_path
from larql.inference.ffn import NullFfn, build_ffn
from larql.inference.ffn.introspect import LastRowRecorder, down_tokens, firing_features
from larql.inference.ffn.policy import LayerFfnRouter
from larql.inference.ffn.walk import WalkFfn
from larql.inference.forward import run_layers
from larql.inference.generation import generate
from larql.inference.layer import embed_rows, final_logits, token_tensor
from larql.models.model import Model

TOKENS_PER_FEATURE = 5
COMPARE_TOP = 5


def forward_logits(model: Model, ffn: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        h, inputs = embed_rows(model, token_tensor(model, ids))  # [S, H], …
        h = run_layers(model, ffn, h, inputs=inputs)
        return final_logits(model, h[-1:])[0]  # [V]


def top_tokens(model: Model, logits: torch.Tensor, n: int) -> list[dict[str, Any]]:
    """The n most likely next tokens as `larql run --top` names them: `{id, text,
    probability}`."""
    probs = torch.softmax(logits.double(), dim=-1)
    values, indices = probs.topk(n)
    return [
        {
            "id": int(i),
            "text": model.tokenizer.decode([int(i)]),
            "probability": round(float(p), 6),
        }
        for p, i in zip(values, indices, strict=True)
    ]


def feature_rows(
    model: Model, router: LayerFfnRouter, ids: list[int], shown: range, top: int
) -> dict[str, Any]:
    recorder = LastRowRecorder(router)
    logits = forward_logits(model, recorder, ids)
    rows = []
    for layer in shown:
        backend = router.backend_for(layer)
        if isinstance(backend, NullFfn) or model.weights.layers[layer].w_gate_up is None:
            # ablated, or a layer of experts alone (no dense features to list)
            rows.append({"layer": layer, "backend": backend.name, "features": []})
            continue
        k = backend.k if isinstance(backend, WalkFfn) and not backend.is_dense else None
        features = firing_features(model, layer, recorder.inputs[layer], k, top)
        rows.append(
            {
                "layer": layer,
                "backend": backend.name,
                "features": [
                    {
                        "feature": f.feature,
                        "activation": round(f.activation, 5),
                        "gate": round(f.gate, 5),
                        "writes": [
                            {"id": t, "text": model.tokenizer.decode([t])}
                            for t in down_tokens(model, layer, f.feature, TOKENS_PER_FEATURE)
                        ],
                    }
                    for f in features
                ],
            }
        )
    return {"position": len(ids) - 1, "layers": rows, "prediction": top_tokens(model, logits, 1)}


def compare_walk(model: Model, router: LayerFfnRouter, ids: list[int]) -> dict[str, Any]:
    dense = build_ffn(model, "dense")
    p_logits, q_logits = forward_logits(model, dense, ids), forward_logits(model, router, ids)
    log_p = torch.log_softmax(p_logits.double(), -1)
    log_q = torch.log_softmax(q_logits.double(), -1)
    kl = float((log_p.exp() * (log_p - log_q)).sum())
    return {
        "dense": top_tokens(model, p_logits, COMPARE_TOP),
        "walk": top_tokens(model, q_logits, COMPARE_TOP),
        "kl_dense_walk": kl,
        "same_top1": int(p_logits.argmax()) == int(q_logits.argmax()),
    }


def predict_tokens(
    model: Model,
    router: LayerFfnRouter,
    engine: Any,
    engine_spec: str,
    ids: list[int],
    max_tokens: int,
    stream: bool,
) -> dict[str, Any]:
    decoder = model.tokenizer.stream_decoder()
    stop_ids = model.tokenizer.stop_ids

    def on_token(token: int) -> None:
        if stream and token not in stop_ids:
            sys.stdout.write(decoder.step(token))
            sys.stdout.flush()

    result = generate(engine, model, router, ids, max_tokens, on_token=on_token)
    if stream:
        sys.stdout.write("\n")
        stderr.print(f"{len(result.tokens)} tokens — engine {engine_spec}, ffn {router.name}")
    visible = [t for t in result.tokens if t not in stop_ids]
    return {
        "engine": engine_spec,
        "token_ids": result.tokens,
        "text": model.tokenizer.decode(visible),
        "finish_reason": result.finish_reason,
        "prefill_ms": round(result.prefill_ms, 3),
        "decode_tok_s": result.decode_tok_s,
        "decode_path": decode_path(model, result.decode_kinds, len(result.step_ms)),
    }
