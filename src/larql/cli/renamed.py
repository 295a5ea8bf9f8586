"""Old spellings of renamed options: still accepted (hidden from --help), with a warning on
stderr naming the new one, so scripts keep working while the CLI speaks one vocabulary:
`--engine` for engine specs (one or several), `--ffn-policy` for FFN policies and `--ffn` for
a remote FFN's URL only, `--top-k` for sampling only, `-n/--max-tokens` for new tokens,
`--prompt-tokens` for a prompt's length, `--depth-percent` for depths in percent (a bare
`--depths` counts tokens), `--output text|json` (`table` was `text`'s old name)."""

from __future__ import annotations

from typing import TypeVar

from larql.cli.common import stderr
from larql.errors import InvalidInput

T = TypeVar("T")


def renamed(new_value: T, old_value: T | None, new: str, old: str, default: T) -> T:
    """The option's value under its new name, or its old one (with a warning); both given:
    an error."""
    if old_value is None:
        return new_value
    if new_value != default:
        raise InvalidInput(f"give {new} only ({old} is its old spelling)")
    stderr.print(f"warning: {old} is deprecated; use {new}")
    return old_value


OUTPUT_OLD_VALUES = {"table": "text"}


def output_format(value: str, accepted: tuple[str, ...]) -> str:
    """`--output`'s value in the one vocabulary (`text` for what a person reads, `json` for
    scripts, `markdown` where a command writes a page); `table`, its old name for `text`, is
    taken with a warning."""
    if value in OUTPUT_OLD_VALUES and value not in accepted:
        new = OUTPUT_OLD_VALUES[value]
        stderr.print(f"warning: --output {value} is deprecated; use --output {new}")
        value = new
    if value not in accepted:
        raise InvalidInput(f"unknown --output {value!r}; accepted: {', '.join(accepted)}")
    return value
