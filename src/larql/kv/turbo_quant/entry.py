"""`turbo-quant`'s catalog entry."""

from __future__ import annotations

from larql.kv.spec import TOKENS, EngineEntry, Sweeps
from larql.kv.turbo_quant.engine import TurboQuantEngine
from larql.specs import Param, at_least, one_of

ATTENTION_DOC = (
    "on CUDA, attend straight from the packed codes and encode through larql's kernels (auto: "
    "2 launches per layer, the partial attention in CUDA C++ where it covers the layer, else "
    "Triton; triton: the 3 Triton launches); on the CPU (auto or triton) a float32 model's "
    "codes are encoded and attended in place by larql's C++ kernels (a plain model's whole "
    "step in one call); sdpa: decode the rows with torch and attend over them, everywhere"
)

GRAPH_DOC = (
    "with the Triton kernels on CUDA, capture the decode step in a CUDA graph (1) or run it "
    "eagerly (0)"
)

# Newest rows kept out of the codes, and their bits, chosen by measurement (docs/FIDELITY.md):
# what meets the mean-KL targets (≤ 0.01 nats at 4 bits, ≤ 0.02 at 3) while the state stays
# ≤ 0.30× / 0.25× of an fp16 full cache at 2k tokens; at 2 and 3 bits int8 rows, twice as many
# in the same bytes, do better than exact ones.
DEFAULT_RECENT = {4: 32, 3: 160, 2: 128}
DEFAULT_RECENT_BITS = {4: 16, 3: 8, 2: 8}

ENTRY = EngineEntry(
    name="turbo-quant",
    purpose="K/V rotated, quantised to 2–4 bits",
    aliases=("turbo_quant", "turboquant", "tq4", "tq3", "tq2"),
    params=(
        Param("bits", int, 4, "bits per K/V coordinate: 2, 3 or 4", one_of(2, 3, 4)),
        Param("k_bits", int, None, "bits of the keys (none: bits)", one_of(2, 3, 4)),
        Param("v_bits", int, None, "bits of the values (none: bits)", one_of(2, 3, 4)),
        Param(
            "recent",
            int,
            None,
            "newest rows kept out of the codes (none: 32 at 4 bits, 160 at 3, 128 at 2)",
            at_least(0),
            bound=TOKENS,
        ),
        Param(
            "recent_bits",
            int,
            None,
            "bits of the recent rows: 16 (exact) or 8 (int8, a float16 scale per head vector; "
            "none: 16 at 4 bits, 8 at 2 and 3)",
            one_of(8, 16),
        ),
        Param(
            "sinks", int, 4, "first rows kept exact (16-bit) for good", at_least(0), bound=TOKENS
        ),
        Param(
            "norm",
            int,
            1,
            "store the norm that gives a decoded row its length back (1) or the plain norm (0)",
            one_of(0, 1),
        ),
        Param(
            "center", int, 1, "quantise rows minus the prompt's mean row per head (1)", one_of(0, 1)
        ),
        Param("attention", str, "auto", ATTENTION_DOC, one_of("auto", "triton", "sdpa")),
        Param("graph", int, 1, GRAPH_DOC, one_of(0, 1)),
    ),
    keeps="K/V in quantised form: per head, a float32 norm and the Lloyd–Max codes of the "
    "signed-Walsh–Hadamard-rotated unit vector (4 + ceil(head_dim·bits/8) bytes), of the rows "
    "minus the prompt's mean row; the first `sinks` rows exact at 16 bits, the newest `recent` "
    "at `recent_bits` (16: exact; 8: int8 with a float16 scale per head vector)",
    contract="bounded KL vs standard (destructive); prefill output exact",
    factory=lambda p, model: TurboQuantEngine(
        bits=p["bits"],
        k_bits=p["k_bits"],
        v_bits=p["v_bits"],
        recent=DEFAULT_RECENT[p["bits"]] if p["recent"] is None else p["recent"],
        recent_bits=p["recent_bits"] or DEFAULT_RECENT_BITS[p["bits"]],
        sinks=p["sinks"],
        norm_correction=bool(p["norm"]),
        center=bool(p["center"]),
        profiling=p["profiling"],
        attention=p["attention"],
        use_graph=bool(p["graph"]),
    ),
    fixed={"tq4": {"bits": 4}, "tq3": {"bits": 3}, "tq2": {"bits": 2}},
    sweeps=Sweeps(
        bench=("bits=4", "bits=3"),
        accuracy=("bits=4", "bits=3", "bits=2"),
        longctx=("bits=4", "bits=2"),
    ),
    batching="yes: with turbo-quant sessions of the same parameters and path; on CUDA the "
    "kernel path runs every session's attention in each layer's three launches and replays one "
    "captured graph per batch size",
)
