"""The spec grammar engines and FFN backends share: `name` or `name:key=value[,key=value…]`.

A spec is split at the first `:`, its parameters on `,` and each parameter at the first `=`;
names and keys are case-insensitive and trimmed. Parsing is strict: a name the caller does not
know, a key without `=`, a key given twice, an unknown key, a `:` with nothing after it, or a
value of the wrong type or out of range is an error naming what was wrong and what is accepted
— never a silent default (a misspelt `windw=4` would otherwise mean an unbounded cache).

`split_specs` cuts a list of specs; `Param` describes and checks one parameter. The engine
catalog (`larql.kv.spec`) and the FFN backend specs (`larql.inference.ffn.spec`) both parse
through `parse_params`, each raising its own error type.

A parameter also says what it is beyond its type, for whoever decides which specs to accept
(`larql.kv.spec.SpecPolicy`): its `kind` — a plain value, a `path` on the machine, a `name` that
becomes a file name, or a `spec` the engine parses — and, for an integer that sizes something,
the `Bound` that limits it (the model's layers, its context, …). A `name` is checked here, for
everyone: always a plain file name, never a path.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from larql.errors import LarqlError

Check = Callable[[Any], str | None]  # a value → what is wrong with it, or None
# the error a parse raises (an alias: inside `Param`, `type` is the field)
ErrorType = type[LarqlError]
TYPE_NAMES = {int: "an integer", float: "a number", str: "a string"}

# value: plain data; path: a file or directory on the machine; name: becomes a file name (so
# always a plain one); spec: another spec, parsed by whoever parses this one
Kind = Literal["value", "path", "name", "spec"]
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
PLAIN_NAME_DOC = (
    "a plain name: letters, digits, '.', '_', '-', at most 128, a letter or digit first"
)


@dataclass(frozen=True)
class Bound:
    """What limits an integer parameter: a `dimension` of the model or of the server that a
    policy knows (`tokens`, `layers`, `heads`, `head_dim`, `vocab`). A count may reach the
    dimension, an `index` stays below it. `always`: past it the engine cannot work, so it is
    checked whenever the model is known, for the operator's specs too; otherwise it limits what
    a request may make the server hold."""

    dimension: str
    index: bool = False
    always: bool = False


@dataclass(frozen=True)
class Param:
    """One parameter: `type` int, float or str; `default` None means absent (e.g. unbounded);
    `none_word` is a value that spells None explicitly (`walk:k=none`); `lower` folds the
    value's case before it is checked; `kind` and `bound` are what a policy reads (above)."""

    name: str
    type: type
    default: Any
    doc: str
    check: Check | None = None
    none_word: str | None = None
    lower: bool = False
    kind: Kind = "value"
    bound: Bound | None = None

    def __post_init__(self) -> None:
        if self.kind != "value" and self.type is not str:
            raise ValueError(f"parameter {self.name}: a {self.kind} is a string")
        if self.bound is not None and self.type is not int:
            raise ValueError(f"parameter {self.name}: only an integer has a bound")

    def parse(self, raw: str, owner: str, error: ErrorType, where: str = "") -> Any:
        if self.none_word is not None and raw.lower() == self.none_word:
            return None
        try:
            value = self.type(raw.lower() if self.lower else raw)
        except ValueError:
            raise error(
                f"{owner}: {self.name}={raw!r} is not {TYPE_NAMES[self.type]}{where}; "
                f"{self.name}: {self.doc}"
            ) from None
        if self.type is str and not value:
            raise error(f"{owner}: {self.name} must not be empty{where}")
        if self.kind == "name" and not PLAIN_NAME.fullmatch(value):
            raise error(f"{owner}: {self.name}={raw!r} is not {PLAIN_NAME_DOC}{where}")
        problem = self.check(value) if self.check else None
        if problem:
            raise error(f"{owner}: {self.name}={raw} {problem}{where}")
        return value

    def describe(self) -> str:
        default = "none" if self.default is None else self.default
        return f"{self.name}={self.type.__name__} (default {default})"


def at_least(n: int) -> Check:
    return lambda v: None if v >= n else f"must be ≥ {n}"


def one_of(*allowed: Any) -> Check:
    choices = ", ".join(str(a) for a in allowed)
    return lambda v: None if v in allowed else f"must be one of {choices}"


def accepted(owner: str, params: Sequence[Param]) -> str:
    if not params:
        return f"{owner} takes no parameters"
    return "accepted: " + ", ".join(p.describe() for p in params)


def split_name(spec: str) -> tuple[str, str, bool]:
    """`name:params` → (name, as written but trimmed; the raw parameters; whether a `:` was
    there)."""
    name, colon, raw = spec.partition(":")
    return name.strip(), raw, bool(colon)


def parse_params(
    owner: str,
    params: Sequence[Param],
    raw: str,
    colon: bool,
    error: type[LarqlError],
    where: str = "",
    fixed: Mapping[str, Any] | None = None,
    alias: str = "",
    admit: Callable[[Param, Any], Any] | None = None,
) -> dict[str, Any]:
    """`key=value,…` → every parameter's value, defaults filled in. `fixed` are values the name
    `alias` sets (`tq3` → bits=3): giving another value for one is an error. Each value written
    in the spec then goes through `admit`, which may refuse it (raising) or replace it (a spec
    parameter by the spec parsed)."""
    values: dict[str, Any] = {p.name: p.default for p in params}
    fixed = fixed or {}
    values.update(fixed)
    if colon and not raw.strip():
        raise error(
            f"{owner}: a ':' but no parameters{where}; write {owner} alone or "
            f"{owner}:key=value; {accepted(owner, params)}"
        )
    seen: set[str] = set()
    for piece in raw.split(",") if raw.strip() else []:
        key, eq, value = piece.partition("=")
        key = key.strip().lower()
        if not eq or not key:
            raise error(
                f"{owner}: {piece.strip()!r} is not key=value{where}; {accepted(owner, params)}"
            )
        param = next((p for p in params if p.name == key), None)
        if param is None:
            raise error(f"{owner}: unknown parameter {key!r}{where}; {accepted(owner, params)}")
        if key in seen:
            raise error(f"{owner}: {key} given twice{where}")
        seen.add(key)
        parsed = param.parse(value.strip(), owner, error, where)
        if key in fixed and fixed[key] != parsed:
            raise error(f"{alias} fixes {key}={fixed[key]}; use {owner}:{key}={parsed} instead")
        values[key] = parsed if admit is None else admit(param, parsed)
    return values


def split_specs(text: str, parses: Callable[[str], bool], semicolons: bool = True) -> list[str]:
    """Cut a list of specs. With `semicolons` and a `;` outside braces, `;` separates them;
    otherwise commas outside braces do, and a piece that does not parse on its own but reads as
    a continuation (`key=value` with no `:` or brace in the key, or a digit first: `28-33`
    after a layer range) is glued back onto the spec before it
    (`boundary-kv:chunk_tokens=64,sequence_id=demo` stays one)."""
    separator = ";" if semicolons and ";" in _outside_braces(text) else ","
    pieces = [p.strip() for p in _split_outside_braces(text, separator)]
    if separator == ";":
        return [p for p in pieces if p]
    out: list[str] = []
    for piece in pieces:
        if not piece:
            continue
        if out and _continues(piece) and not parses(piece):
            out[-1] = f"{out[-1]},{piece}"
        else:
            out.append(piece)
    return out


def _outside_braces(text: str) -> str:
    depth, kept = 0, []
    for ch in text:
        depth += (ch == "{") - (ch == "}")
        if depth <= 0 and ch not in "{}":
            kept.append(ch)
    return "".join(kept)


def _split_outside_braces(text: str, separator: str) -> list[str]:
    pieces: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in text:
        depth += (ch == "{") - (ch == "}")
        if ch == separator and depth <= 0:
            pieces.append("".join(current))
            current = []
        else:
            current.append(ch)
    pieces.append("".join(current))
    return pieces


def _continues(piece: str) -> bool:
    key = piece.split("=", 1)[0]
    return piece[0].isdigit() or ("=" in piece and ":" not in key and "{" not in key)
