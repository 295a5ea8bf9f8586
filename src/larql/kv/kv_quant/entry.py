"""`kv-quant`'s catalog entry."""

from __future__ import annotations

from larql.kv.kv_quant.engine import KvQuantEngine
from larql.kv.spec import HEAD_DIM, TOKENS, EngineEntry, Sweeps
from larql.specs import Param, at_least, one_of

ENTRY = EngineEntry(
    name="kv-quant",
    purpose="K/V as int or fp8 codes, per group",
    aliases=("kv_quant", "kivi"),
    params=(
        Param("bits", int, 4, "integer code bits: 2, 4 or 8 (format=int)", one_of(2, 4, 8)),
        Param(
            "format",
            str,
            "int",
            "int (scale + zero point per group) or fp8 (e4m3, a scale per group)",
            one_of("int", "fp8"),
            lower=True,
        ),
        Param("group", int, 32, "coordinates per scale (per token)", at_least(1), bound=HEAD_DIM),
        Param("rotate", int, 0, "Walsh–Hadamard-rotate each row first (1)", one_of(0, 1)),
        Param("recent", int, 0, "newest rows kept out of the codes", at_least(0), bound=TOKENS),
        Param(
            "recent_bits",
            int,
            16,
            "bits of the recent rows: 16 (exact) or 8 (int8, a float16 scale per head vector)",
            one_of(8, 16),
        ),
        Param("sinks", int, 0, "first rows kept exact (16-bit)", at_least(0), bound=TOKENS),
        Param(
            "attention",
            str,
            "auto",
            "auto: on CUDA attend straight from int2/int4/int8 codes (of a power-of-two width, "
            "in power-of-two groups) and encode through larql's Triton kernels, the step in a "
            "CUDA graph; on the CPU a float32 model's codes in place in larql's C++ kernels; "
            "sdpa: decode every stored row with torch and attend over them, everywhere",
            one_of("auto", "sdpa"),
            lower=True,
        ),
        Param(
            "graph",
            int,
            1,
            "with the Triton kernels on CUDA, capture the decode step in a CUDA graph (1) or run "
            "it eagerly (0)",
            one_of(0, 1),
        ),
    ),
    keeps="K/V as per-token groups of integer (scale + zero point) or fp8 (scale) codes; "
    "optional exact recent and sink rows; every scale and zero point counted",
    contract="bounded KL vs standard (destructive); prefill output exact",
    factory=lambda p, model: KvQuantEngine(
        bits=p["bits"],
        fp8=p["format"] == "fp8",
        group=p["group"],
        rotate=bool(p["rotate"]),
        recent=p["recent"],
        recent_bits=p["recent_bits"],
        sinks=p["sinks"],
        profiling=p["profiling"],
        attention=p["attention"],
        use_graph=bool(p["graph"]),
    ),
    batching="yes: with kv-quant sessions of the same parameters and path; on CUDA the kernel "
    "path runs every session's attention in each layer's launches and replays one captured "
    "graph per batch size",
    sweeps=Sweeps(bench=("bits=4",), accuracy=("bits=4",), longctx=("bits=4",)),
)
