"""`larql cache` and `larql cache clear`: where larql keeps what it rebuilds from model files
(dequantised weights, tokenizers; larql.models.cache), how much each part holds, and removing
it."""

from __future__ import annotations

import typer

from larql.cli.common import user_errors

cache_app = typer.Typer(
    help="The cache of dequantised weights: where it is and its size (clear: remove it).",
    invoke_without_command=True,
)


def size(n: int) -> str:
    """1536 → `1.5 KiB`: bytes in binary units, one decimal."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@cache_app.callback()
@user_errors
def show(context: typer.Context) -> None:
    """Where the cache is and what each part of it holds."""
    if context.invoked_subcommand is not None:
        return
    from larql.models.cache import CACHE_PARTS, cache_dir, cache_usage

    usage = cache_usage()
    # plain lines: a path is never wrapped
    print(
        f"cache: {cache_dir()}  (LARQL_CACHE_DIR, else $XDG_CACHE_HOME/larql, else ~/.cache/larql)"
    )
    for part, held in usage.items():
        print(f"  {part:<12} {size(held):>10}  {CACHE_PARTS[part]}")
    total = sum(usage.values())
    tail = "; larql cache clear removes it (rebuilt when next needed)" if total else " (empty)"
    print(f"total {size(total)}{tail}")


@cache_app.command()
@user_errors
def clear() -> None:
    """Remove the cache's parts (each is rebuilt when next needed)."""
    from larql.models.cache import cache_dir, clear_cache

    removed = clear_cache()
    for part, held in removed.items():
        print(f"removed {cache_dir() / part} ({size(held)})")
    print(f"freed {size(sum(removed.values()))}")
