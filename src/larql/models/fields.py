"""Typed reads of the settings a model file carries (an HF `config.json`, a GGUF's metadata).

Every value is checked for its type and range before anything is sized from it; a bad one is a
`ModelFormatError` naming the key, the value and what is accepted (the loader adds the file).
The limits are far above any released model and low enough that what is sized from a config
before its weights are checked (layer specs, a bias of zeros) stays small.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from larql.models.errors import ModelFormatError

MAX_LAYERS = 1024
MAX_WIDTH = 1 << 20  # hidden, MLP and projection widths
MAX_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_VOCAB = 1 << 22
MAX_CONTEXT = 1 << 25
MAX_EXPERTS = 4096

_REQUIRED: Any = object()
_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 40
_SHOW.maxlist = _SHOW.maxdict = 4


def show(value: object) -> str:
    """A short repr of a value read from a file, for a one-line message."""
    return _SHOW.repr(value)


class Lookup(Protocol):
    def get(self, key: str, /) -> Any: ...


class Fields:
    """Typed, bounded reads of `values` (a mapping, or anything with its `get`), each key shown
    in messages as `prefix` + key (e.g. `llama.block_count`, `rope_parameters.factor`). A key
    that is absent or null takes the default; without one it is a missing key."""

    def __init__(self, values: Lookup, prefix: str = "") -> None:
        self._values = values
        self.prefix = prefix

    def raw_mapping(self) -> Any:
        """The values themselves (for a rule that reads them its own way)."""
        return self._values

    def keys(self) -> list[str]:
        return [str(k) for k in self._values] if isinstance(self._values, Mapping) else []

    def has(self, key: str) -> bool:
        return self._values.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        value = self._values.get(key)
        return default if value is None else value

    def integer(
        self, key: str, default: Any = _REQUIRED, *, low: int = 0, high: int | None = None
    ) -> int:
        value = self._values.get(key)
        if value is None:
            value = self._default(key, default)  # a default is checked too (it may be derived)
            if value is None:
                return None  # type: ignore[return-value]
        number = _as_int(value)
        if number is None:
            raise self._wrong(key, value, "an integer")
        if number < low or (high is not None and number > high):
            accepted = f"{low}..{high}" if high is not None else f"≥ {low}"
            shown = show(number)
            raise ModelFormatError(f"{self.prefix}{key} = {shown} is out of range ({accepted})")
        return number

    def optional_integer(self, key: str, *, low: int = 0, high: int | None = None) -> int | None:
        return self.integer(key, None, low=low, high=high)

    def integers(self, key: str, *, low: int = 0, high: int | None = None) -> tuple[int, ...]:
        """An integer or a list of them (`eos_token_id`); () where absent."""
        value = self._values.get(key)
        items = value if isinstance(value, list) else [] if value is None else [value]
        numbers = Fields({f"[{i}]": item for i, item in enumerate(items)}, self.prefix + key)
        return tuple(numbers.integer(f"[{i}]", low=low, high=high) for i in range(len(items)))

    def number(self, key: str, default: Any = _REQUIRED, *, positive: bool = False) -> float:
        """A finite float (an integer is one too); `positive`: > 0."""
        value = self._values.get(key)
        if value is None:
            return self._default(key, default)
        if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.number):
            raise self._wrong(key, value, "a number")
        try:
            number = float(value)
        except OverflowError:  # an integer past any float
            number = math.inf
        if not math.isfinite(number) or (positive and number <= 0):
            raise self._wrong(key, value, "a positive number" if positive else "a finite number")
        return number

    def optional_number(self, key: str, *, positive: bool = False) -> float | None:
        return self.number(key, None, positive=positive)

    def flag(self, key: str, default: bool) -> bool:
        value = self._values.get(key)
        if value is None:
            return default
        if isinstance(value, bool | np.bool_):
            return bool(value)
        if _as_int(value) in (0, 1):
            return bool(value)
        raise self._wrong(key, value, "true or false")

    def text(self, key: str, default: Any = _REQUIRED) -> str:
        value = self._values.get(key)
        if value is None:
            return self._default(key, default)
        if not isinstance(value, str):
            raise self._wrong(key, value, "a string")
        return value

    def mapping(self, key: str) -> Fields | None:
        """The object under `key` as fields of its own (None where absent)."""
        value = self._values.get(key)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise self._wrong(key, value, "an object")
        return Fields(value, f"{self.prefix}{key}.")

    def _default(self, key: str, default: Any) -> Any:
        if default is _REQUIRED:
            raise ModelFormatError(f"{self.prefix}{key} is missing")
        return default

    def _wrong(self, key: str, value: object, accepted: str) -> ModelFormatError:
        return ModelFormatError(f"{self.prefix}{key} is {show(value)}, expected {accepted}")


def _as_int(value: object) -> int | None:
    """An integer value (a float equal to one too: `4096.0`); None for anything else."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating) and math.isfinite(value) and float(value) % 1 == 0:
        return int(value)
    return None
