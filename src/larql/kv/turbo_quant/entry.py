"""`turbo-quant`'s catalog entry."""

from __future__ import annotations

from larql.kv.spec import EngineEntry
from larql.kv.turbo_quant.engine import TurboQuantEngine
from larql.specs import Param, one_of

ATTENTION_DOC = (
    "on CUDA, attend straight from the packed codes and encode through larql's Triton kernels "
    "(auto, triton: 2 launches per layer) or decode the rows with torch and use SDPA (sdpa)"
)

GRAPH_DOC = (
    "with the Triton kernels on CUDA, capture the decode step in a CUDA graph (1) or run it "
    "eagerly (0)"
)

ENTRY = EngineEntry(
    name="turbo-quant",
    aliases=("turbo_quant", "turboquant", "tq4", "tq3", "tq2"),
    params=(
        Param("bits", int, 4, "bits per K/V coordinate: 2, 3 or 4", one_of(2, 3, 4)),
        Param("attention", str, "auto", ATTENTION_DOC, one_of("auto", "triton", "sdpa")),
        Param("graph", int, 1, GRAPH_DOC, one_of(0, 1)),
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
