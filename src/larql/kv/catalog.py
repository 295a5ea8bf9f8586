"""The engine catalog: every engine larql can build, its names, parameters, what it keeps and
its correctness contract. `larql engines`, the README table and the spec parser all read this."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from larql.inference.engine import KvEngine
from larql.kv.apollo import build_apollo
from larql.kv.boundary import BoundaryKvEngine, DirectoryBoundaryArchive
from larql.kv.no_cache import NoCacheEngine
from larql.kv.residual import (
    BoundaryPerLayerEngine,
    MarkovResidualCodecEngine,
    MarkovResidualEngine,
)
from larql.kv.spec import EngineCatalog, EngineEntry, EngineSpec
from larql.kv.standard import StandardEngine
from larql.kv.static_cache import StaticCacheEngine
from larql.kv.turbo_quant import TurboQuantEngine
from larql.kv.windowed_checkpoint import DEFAULT_WINDOW, WindowedCheckpointEngine
from larql.models.model import Model
from larql.specs import Param, at_least, one_of

WINDOW_DOC = "keys each query sees, itself included (none = unbounded)"

GRAPH_DOC = (
    "on CUDA, decode through a static cache and a captured CUDA graph (1) or eagerly (0); "
    "CPU always runs eagerly"
)

COMPILE_DOC = (
    "on CUDA, also fuse the decode step's small kernels with torch.compile (1; the first "
    "step compiles for a minute) or not (0)"
)

ATTENTION_DOC = (
    "decode attention of the CUDA fast path: larql's split-key Triton kernel (auto, triton; "
    "where Triton is installed) or torch's fused attention over the masked static cache (sdpa)"
)

TQ_ATTENTION_DOC = (
    "on CUDA, attend straight from the packed codes and encode through larql's Triton kernels "
    "(auto, triton: 2 launches per layer) or decode the rows with torch and use SDPA (sdpa)"
)

TQ_GRAPH_DOC = (
    "with the Triton kernels on CUDA, capture the decode step in a CUDA graph (1) or run it "
    "eagerly (0)"
)

CATALOG = EngineCatalog()


def build_standard(p: Mapping[str, Any], model: Model | None) -> KvEngine:
    if p["graph"] and model is not None and model.device.type == "cuda":
        return StaticCacheEngine(
            window=p["window"], compile=bool(p["compile"]), attention=p["attention"]
        )
    return StandardEngine(window=p["window"])


HOT_WINDOW_DOC = (
    "hot residual rows per layer; older rows go to the cold tier (attention stays full)"
)

CATALOG.register(
    EngineEntry(
        name="standard",
        aliases=("full", "fp32", "markov-bounded", "bounded", "sliding"),
        params=(
            Param("window", int, None, WINDOW_DOC, at_least(1)),
            Param("graph", int, 1, GRAPH_DOC, one_of(0, 1)),
            Param("compile", int, 0, COMPILE_DOC, one_of(0, 1)),
            Param("attention", str, "auto", ATTENTION_DOC, one_of("auto", "triton", "sdpa")),
        ),
        keeps="K/V of every layer (the last window−1 rows when windowed), model dtype",
        contract="the reference; window=N is sliding-window attention over N keys",
        factory=build_standard,
    )
)

CATALOG.register(
    EngineEntry(
        name="no-cache",
        aliases=("no_cache", "none", "off"),
        params=(),
        keeps="token ids only; re-runs the whole forward pass each step (O(N²))",
        contract="exact vs standard (logits ≤1e-9 relative in float64)",
        factory=lambda p, model: NoCacheEngine(),
    )
)

CATALOG.register(
    EngineEntry(
        name="markov-rs",
        aliases=("markov_rs", "markov-residual", "markov_residual"),
        params=(Param("window", int, None, HOT_WINDOW_DOC, at_least(1)),),
        keeps="pre-layer residuals per layer (hot: last window rows; cold: the rest, lossless); "
        "K/V of every position as a droppable derivative",
        contract="exact vs standard at any window (window splits storage, not attention)",
        factory=lambda p, model: MarkovResidualEngine(
            window=p["window"], profiling=p["profiling"], model=model
        ),
    )
)

CATALOG.register(
    EngineEntry(
        name="markov-rs-codec",
        aliases=("markov_rs_codec", "markov-residual-codec", "markov_residual_codec"),
        params=(Param("window", int, None, HOT_WINDOW_DOC, at_least(1)),),
        keeps="as markov-rs, cold residuals as bf16 (2 bytes/element); cold K/V recomputed "
        "from the round-tripped residuals at their true positions",
        contract="identical to markov-rs until a row overflows the window; then mean KL vs "
        "standard ≤ 0.01 nats",
        factory=lambda p, model: MarkovResidualCodecEngine(
            window=p["window"], profiling=p["profiling"], model=model
        ),
    )
)

CATALOG.register(
    EngineEntry(
        name="windowed-checkpoint",
        aliases=("unlimited-context", "unlimited", "unlimited_context", "windowed_checkpoint"),
        params=(
            Param(
                "window",
                int,
                DEFAULT_WINDOW,
                "tokens per tumbling window; each window is seeded by a one-row K/V checkpoint "
                "of the previous window's last token",
                at_least(1),
            ),
        ),
        keeps="K/V of the current window + one K/V row per layer per closed window "
        "(checkpoints) + every token id (int32 archive)",
        contract="exact vs standard inside the first window; after it each token attends only "
        "the checkpoint row and its own window (documented loss)",
        factory=lambda p, model: WindowedCheckpointEngine(
            window=p["window"], profiling=p["profiling"]
        ),
    )
)

CATALOG.register(
    EngineEntry(
        name="turbo-quant",
        aliases=("turbo_quant", "turboquant", "tq4", "tq3", "tq2"),
        params=(
            Param("bits", int, 4, "bits per K/V coordinate: 2, 3 or 4", one_of(2, 3, 4)),
            Param("attention", str, "auto", TQ_ATTENTION_DOC, one_of("auto", "triton", "sdpa")),
            Param("graph", int, 1, TQ_GRAPH_DOC, one_of(0, 1)),
        ),
        keeps="K/V only in quantised form: per head, a float32 norm and the Lloyd–Max codes "
        "of the signed-Walsh–Hadamard-rotated unit vector (4 + ceil(head_dim·bits/8) bytes)",
        contract="bounded KL vs standard (destructive); prefill output exact",
        factory=lambda p, model: TurboQuantEngine(
            bits=p["bits"],
            profiling=p["profiling"],
            attention=p["attention"],
            use_graph=bool(p["graph"]),
        ),
        fixed={"tq4": {"bits": 4}, "tq3": {"bits": 3}, "tq2": {"bits": 2}},
    )
)

CATALOG.register(
    EngineEntry(
        name="apollo",
        aliases=(),
        params=(
            Param("layer", int, None, "injection layer (none = the store's)", at_least(0)),
            Param(
                "coef",
                float,
                10.0,
                "scale of the injected fact-token embeddings",
                lambda v: None if math.isfinite(v) else "must be finite",
            ),
            Param("top_k", int, 8, "entries retrieved from the routed window", at_least(1)),
            Param("store", str, None, "store directory from `larql apollo build-store`"),
        ),
        keeps="a prebuilt store (window tokens, boundary residuals, fact entries) and the "
        "context token ids; no K/V — every step re-runs the forward pass (O(N²))",
        contract="task-level retrieval only, never exact; bench and accuracy only (no live "
        "decode); without store= prefill is a RetrievalMiss",
        factory=lambda p, model: build_apollo(p["layer"], p["coef"], p["top_k"], p["store"], model),
        kind="retrieval",
        live_decode=False,
    )
)

CATALOG.register(
    EngineEntry(
        name="boundary-kv",
        aliases=("boundary",),
        params=(
            Param(
                "chunk_tokens", int, 512, "tokens per chunk; a frame at every multiple", at_least(1)
            ),
            Param(
                "sequence_id",
                str,
                None,
                "sequence the frames belong to (none: a fresh id per run; an archive refuses a "
                "sequence another run wrote)",
            ),
            Param("window", int, None, WINDOW_DOC + " (of the inner standard engine)", at_least(1)),
            Param("archive", str, None, "directory to write frames to (none = in memory)"),
        ),
        keeps="standard K/V; boundary frames (residual, top-1/top-2, int8 agreement) go to the "
        "archive, not the engine's memory",
        contract="exact vs standard (it is standard); a frame at every multiple of chunk_tokens",
        factory=lambda p, model: BoundaryKvEngine(
            chunk_tokens=p["chunk_tokens"],
            sequence_id=p["sequence_id"],
            window=p["window"],
            archive=DirectoryBoundaryArchive(p["archive"]) if p["archive"] else None,
        ),
    )
)

CATALOG.register(
    EngineEntry(
        name="boundary-per-layer",
        aliases=("boundary_per_layer", "boundary-pl"),
        params=(
            Param("window", int, None, HOT_WINDOW_DOC, at_least(1)),
            Param(
                "layers", int, None, "layers of the codec policy (none = model depth)", at_least(1)
            ),
        ),
        keeps="as markov-rs-codec, with a per-layer cold codec policy (v1: bf16 per layer) "
        "and its calibration record",
        contract="bounded KL per calibrated policy (bf16: 0.01 nats); greedy tokens agree "
        "with markov-rs-codec at the same window",
        factory=lambda p, model: BoundaryPerLayerEngine(
            window=p["window"], layers=p["layers"], profiling=p["profiling"], model=model
        ),
    )
)


def catalog_rows() -> list[dict[str, Any]]:
    """The catalog as plain data (`larql engines --output json`, `GET /v1/engines`)."""
    return [
        {
            "name": e.name,
            "aliases": list(e.aliases),
            "params": [
                {"name": p.name, "type": p.type.__name__, "default": p.default, "doc": p.doc}
                for p in e.params
            ],
            "keeps": e.keeps,
            "contract": e.contract,
            "kind": e.kind,
            "live_decode": e.live_decode,
        }
        for e in CATALOG.entries
    ]


def parse_engine(spec: str) -> EngineSpec:
    return CATALOG.parse(spec)


def supported_names() -> list[str]:
    return CATALOG.supported_names()


def split_specs(specs: str) -> list[str]:
    return CATALOG.split_specs(specs)
