"""The `LARQL_*` environment variables larql reads, and a warning for those set that it does
not: a knob of another LARQL build (`LARQL_SPIN_POOL`, `LARQL_W10_…`) or a misspelt one would
otherwise change nothing without a word. tests/test_cli_small_gaps.py keeps `READ_VARIABLES`
equal to what the sources read (docs/CLI.md, "Environment variables", lists them)."""

from __future__ import annotations

import os
from collections.abc import Mapping

PREFIX = "LARQL_"
READ_VARIABLES = frozenset(
    {
        "LARQL_KV_ENGINE",
        "LARQL_CACHE_DIR",
        "LARQL_NO_PLUGINS",
        "LARQL_NO_AMX",
        "LARQL_NO_TILES",
        "LARQL_TEST_THREADS",
    }
)


def unread_variables(env: Mapping[str, str] | None = None) -> list[str]:
    """The `LARQL_*` variables set in `env` (the process's) that larql does not read, sorted."""
    env = os.environ if env is None else env
    return sorted(name for name in env if name.startswith(PREFIX) and name not in READ_VARIABLES)


def unread_warning(env: Mapping[str, str] | None = None) -> str | None:
    """One line naming them (None: there are none)."""
    unread = unread_variables(env)
    if not unread:
        return None
    verb = "is" if len(unread) == 1 else "are"
    return (
        f"warning: {', '.join(unread)} {verb} set but larql does not read "
        f"{'it' if len(unread) == 1 else 'them'} (ignored); the variables it reads: docs/CLI.md, "
        '"Environment variables"'
    )
