"""The catalog's built-in engines by name, for help texts: `--help` answers without importing
torch, which the catalog's engine modules do. tests/test_cli_small_gaps.py keeps this list equal
to the catalog's (`larql.kv.catalog.CATALOG`); engines of other packages (plugins) are listed by
`larql engines`."""

from __future__ import annotations

BUILTIN_ENGINES = (
    "standard",
    "no-cache",
    "markov-rs",
    "markov-rs-codec",
    "windowed-checkpoint",
    "turbo-quant",
    "kv-quant",
    "snapkv",
    "h2o",
    "tova",
    "keydiff",
    "expected-attention",
    "kvzip",
    "apollo",
    "boundary-kv",
    "boundary-per-layer",
    "semantic-promotion",
)


def engines_help() -> str:
    """`engines: standard, no-cache, … (larql engines: their parameters)`."""
    return f"Engines: {', '.join(BUILTIN_ENGINES)} (larql engines: their parameters)."
