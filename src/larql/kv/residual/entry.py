"""The catalog entries of the residual-stream engines: markov-rs, markov-rs-codec and
boundary-per-layer."""

from __future__ import annotations

from larql.kv.residual.codec_engine import MarkovResidualCodecEngine
from larql.kv.residual.markov import MarkovResidualEngine
from larql.kv.residual.per_layer import BoundaryPerLayerEngine
from larql.kv.spec import MODEL_LAYERS, TOKENS, EngineEntry, Sweeps
from larql.specs import Param, at_least, one_of

HOT_WINDOW_DOC = (
    "hot residual rows per layer; older rows go to the cold tier (attention stays full)"
)
BATCHING = (
    "yes: with sessions of the same engine and parameters that keep their K/V (kv_cache=1), "
    "every layer of the step in one call on the CPU's compiled layer (the weights read once for "
    "all), a new prompt riding in it (in chunks with a lossless cold tier or no window, else "
    "whole); elsewhere each steps in turn"
)
KV_CACHE_DOC = (
    "1: keep every position's K/V beside the residuals (fast; residuals + K/V: more bytes than "
    "standard's cache); 0: recompute all K/V from the residuals every step (the state is the "
    "residuals alone — below a full K/V cache only where K and V together are wider than the "
    "hidden state, i.e. without grouped-query attention; on SmolLM2 (576 vs 384 per row) "
    "still above; a projection of the whole history per layer per step)"
)

MARKOV_RS = EngineEntry(
    name="markov-rs",
    purpose="residuals, not K/V; exact",
    aliases=("markov_rs", "markov-residual", "markov_residual"),
    params=(
        Param("window", int, None, HOT_WINDOW_DOC, at_least(1), bound=TOKENS),
        Param("kv_cache", int, 1, KV_CACHE_DOC, one_of(0, 1)),
    ),
    keeps="pre-layer residuals per layer (hot: last window rows; cold: the rest, lossless); "
    "K/V of every position as a droppable derivative (none with kv_cache=0)",
    contract="exact vs standard at any window (window splits storage, not attention), in "
    "either kv_cache mode",
    factory=lambda p, model: MarkovResidualEngine(
        window=p["window"], profiling=p["profiling"], model=model, kv_cache=bool(p["kv_cache"])
    ),
    batching=BATCHING,
    sweeps=Sweeps(bench=("", "window=4"), accuracy=("window=64",), longctx=()),  # exact
)

MARKOV_RS_CODEC = EngineEntry(
    name="markov-rs-codec",
    purpose="markov-rs, cold residuals in bf16",
    aliases=("markov_rs_codec", "markov-residual-codec", "markov_residual_codec"),
    params=(Param("window", int, None, HOT_WINDOW_DOC, at_least(1), bound=TOKENS),),
    keeps="as markov-rs, cold residuals as bf16 (2 bytes/element); cold K/V recomputed "
    "from the round-tripped residuals at their true positions",
    contract="identical to markov-rs until a row overflows the window; then mean KL vs "
    "standard ≤ 0.01 nats",
    factory=lambda p, model: MarkovResidualCodecEngine(
        window=p["window"], profiling=p["profiling"], model=model
    ),
    batching=BATCHING,
    sweeps=Sweeps(bench=("window=4",), accuracy=("window=64",), longctx=()),
)

BOUNDARY_PER_LAYER = EngineEntry(
    name="boundary-per-layer",
    purpose="markov-rs-codec, a codec per layer",
    aliases=("boundary_per_layer", "boundary-pl"),
    params=(
        Param("window", int, None, HOT_WINDOW_DOC, at_least(1), bound=TOKENS),
        Param(
            "layers",
            int,
            None,
            "layers of the codec policy (none = model depth)",
            at_least(1),
            bound=MODEL_LAYERS,
        ),
    ),
    keeps="as markov-rs-codec, with a per-layer cold codec policy (v1: bf16 per layer) "
    "and its calibration record",
    contract="bounded KL per calibrated policy (bf16: 0.01 nats); greedy tokens agree "
    "with markov-rs-codec at the same window",
    factory=lambda p, model: BoundaryPerLayerEngine(
        window=p["window"], layers=p["layers"], profiling=p["profiling"], model=model
    ),
    batching=BATCHING,
    sweeps=Sweeps(bench=("window=4",), accuracy=("window=64",), longctx=()),
)
