"""`windowed-checkpoint`'s catalog entry."""

from __future__ import annotations

from larql.kv.spec import TOKENS, EngineEntry, Sweeps
from larql.kv.windowed_checkpoint.engine import DEFAULT_WINDOW, WindowedCheckpointEngine
from larql.specs import Param, at_least

ENTRY = EngineEntry(
    name="windowed-checkpoint",
    purpose="a window of K/V + checkpoint rows",
    aliases=("unlimited-context", "unlimited", "unlimited_context", "windowed_checkpoint"),
    params=(
        Param(
            "window",
            int,
            DEFAULT_WINDOW,
            "tokens per tumbling window; each window is seeded by a one-row K/V checkpoint "
            "of the previous window's last token",
            at_least(1),
            bound=TOKENS,
        ),
    ),
    keeps="K/V of the current window + one K/V row per layer per closed window "
    "(checkpoints) + every token id (int32 archive)",
    contract="exact vs standard inside the first window; after it each token attends only "
    "the checkpoint row and its own window (documented loss)",
    factory=lambda p, model: WindowedCheckpointEngine(window=p["window"], profiling=p["profiling"]),
    sweeps=Sweeps(bench=("window=4",), accuracy=("window=64",), longctx=()),
)
