"""Engines from other packages: an installed distribution declares entry points in the group
`larql.engines`, each naming an `EngineEntry` (the object a built-in engine's package exports
as `ENTRY`). The catalog adds them after the built-ins, the first time it is used, so they
appear in `larql engines` and parse everywhere a spec does (run, walk, bench, accuracy,
serve, the Python API).

A plugin that cannot be used is left out with one warning line on the `larql.plugins` logger
(printed on stderr when logging is not configured) — never a traceback, and the rest of the
catalog still works: one that fails to import, one that is not an `EngineEntry`, one whose
entry point name is not its engine's name, one with a name the grammar cannot parse, and one
whose name (or alias) a built-in engine or an earlier plugin already has.
`LARQL_NO_PLUGINS=1` leaves every plugin out."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Iterable, Iterator
from importlib.metadata import EntryPoint, entry_points

from larql.kv.spec import EngineEntry

GROUP = "larql.engines"
DISABLE_VAR = "LARQL_NO_PLUGINS"
NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")  # what `name:params` can spell, lower case

log = logging.getLogger("larql.plugins")


def installed() -> list[EntryPoint]:
    """The `larql.engines` entry points of every installed distribution (none when
    `LARQL_NO_PLUGINS` is set to anything but 0 or empty)."""
    if os.environ.get(DISABLE_VAR, "") not in ("", "0"):
        return []
    return sorted(entry_points(group=GROUP), key=lambda ep: ep.name)


def plugin_entries(
    taken: Iterable[str], found: Iterable[EntryPoint] | None = None
) -> Iterator[EngineEntry]:
    """The usable entries of `found` (default: `installed()`), each marked with the
    distribution it came from; names in `taken` (and those of earlier plugins) are refused."""
    names = set(taken)
    for ep in installed() if found is None else found:
        entry = _load(ep, names)
        if entry is not None:
            names.update(entry.all_names)
            yield entry


def _load(ep: EntryPoint, taken: set[str]) -> EngineEntry | None:
    where = f"engine plugin {ep.name!r} ({_origin(ep)}, {ep.value})"
    try:
        entry = ep.load()
    except Exception as e:  # a plugin's import can fail any way; it must not stop larql
        return _skip(f"{where} was not loaded: {type(e).__name__}: {e}")
    if not isinstance(entry, EngineEntry):
        return _skip(f"{where} is not a larql EngineEntry (it is a {type(entry).__name__})")
    if entry.name != ep.name:
        return _skip(
            f"{where} registers an engine named {entry.name!r}: the entry point's name "
            "must be the engine's name"
        )
    bad = [n for n in entry.all_names if not NAME.match(n)]
    if bad:
        return _skip(
            f"{where}: {bad[0]!r} is not a usable engine name (lower-case letters, "
            "digits, '-', '_', '.')"
        )
    clash = [n for n in entry.all_names if n in taken]
    if clash:
        return _skip(
            f"{where} was refused: the name {clash[0]!r} is already an engine's "
            "(built-in engines and earlier plugins keep theirs)"
        )
    return dataclasses.replace(entry, plugin=_origin(ep))


def _origin(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else ep.module


def _skip(message: str) -> None:
    log.warning("warning: %s", message)
    return None
