"""An engine's state as declared data: named tensors and typed plain fields.

An engine writes its state through a `StateWriter` (`put` a plain field, `tensor` a tensor, under
dotted names such as `layers.3.k`) and reads it back through a `StateReader`, which checks every
value as it is read: a field's type and range, a tensor's dtype and its exact shape (what the
engine's spec and the model imply). Whatever the engine did not ask for is refused by `finish`,
as is anything missing or out of place — a one-line `SnapshotCorrupt` naming the entry and what
was expected. Nothing in a state names code: the engine to rebuild comes from its spec, parsed by
the catalog, and its fields are numbers, strings, booleans and lists of them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from larql.inference.snapshots.errors import SnapshotCorrupt

Plain = None | bool | int | float | str | list[Any]
_MAX_TEXT = 4096  # characters in a string field


class StateWriter:
    """Collects one engine's fields and tensors. `keep_device`: tensors are copied where they
    are (an in-memory fork), else onto the CPU (a file)."""

    def __init__(
        self,
        keep_device: bool = False,
        prefix: str = "",
        fields: dict[str, Plain] | None = None,
        tensors: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.keep_device = keep_device
        self.prefix = prefix
        self.fields: dict[str, Plain] = {} if fields is None else fields
        self.tensors: dict[str, torch.Tensor] = {} if tensors is None else tensors

    def scope(self, name: str | int) -> StateWriter:
        """A writer whose names start with `name.` (the same fields and tensors)."""
        return StateWriter(self.keep_device, f"{self.prefix}{name}.", self.fields, self.tensors)

    def put(self, name: str, value: Plain) -> None:
        self.fields[self.prefix + name] = value

    def tensor(self, name: str, value: torch.Tensor | None) -> None:
        """Write `value` (nothing for None: the reader finds it absent)."""
        if value is None:
            return
        target = value.device if self.keep_device else "cpu"
        self.tensors[self.prefix + name] = value.detach().to(target, copy=True).contiguous()


class StateReader:
    """Reads and checks one engine's fields and tensors; `device`: where tensors go."""

    def __init__(
        self,
        fields: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
        prefix: str = "",
        read: set[str] | None = None,
    ) -> None:
        self.fields, self.tensors = fields, tensors
        self.device = torch.device(device)
        self.prefix = prefix
        self._read: set[str] = set() if read is None else read

    def scope(self, name: str | int) -> StateReader:
        return StateReader(
            self.fields, self.tensors, self.device, f"{self.prefix}{name}.", self._read
        )

    # ------------------------------------------------------------------ fields

    def _field(self, name: str) -> Any:
        key = self.prefix + name
        if key not in self.fields:
            raise SnapshotCorrupt(f"the state has no field {key!r}")
        self._read.add(key)
        return self.fields[key]

    def has_field(self, name: str) -> bool:
        """Whether the state holds field `name` (a layout the engine may write either way)."""
        return self.prefix + name in self.fields

    def integer(self, name: str, least: int = 0, most: int | None = None) -> int:
        value = self._field(name)
        if type(value) is not int:
            raise self._wrong(name, value, "an integer")
        if value < least or (most is not None and value > most):
            span = f"{least}..{most}" if most is not None else f"≥ {least}"
            raise SnapshotCorrupt(f"state field {self.prefix + name!r} is {value}, not in {span}")
        return value

    def flag(self, name: str) -> bool:
        value = self._field(name)
        if type(value) is not bool:
            raise self._wrong(name, value, "true or false")
        return value

    def text(self, name: str, pattern: str | None = None) -> str:
        """A string field (at most 4,096 characters; matching `pattern` where given)."""
        value = self._field(name)
        if type(value) is not str or len(value) > _MAX_TEXT:
            raise self._wrong(name, value, "a string")
        if pattern is not None and re.fullmatch(pattern, value) is None:
            raise SnapshotCorrupt(
                f"state field {self.prefix + name!r} = {value[:40]!r} is not of the form {pattern}"
            )
        return value

    def plain(self, name: str) -> Any:
        """A field of any plain type, for a caller that checks it itself."""
        return self._field(name)

    def _wrong(self, name: str, value: Any, expected: str) -> SnapshotCorrupt:
        shown = type(value).__name__ if not isinstance(value, str | int | float) else repr(value)
        return SnapshotCorrupt(
            f"state field {self.prefix + name!r} is {shown[:40]}, not {expected}"
        )

    # ------------------------------------------------------------------ tensors

    def tensor(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """The tensor `name`, which must be `dtype` and exactly `shape`, on the reader's device."""
        key = self.prefix + name
        found = self.tensors.get(key)
        if found is None:
            raise SnapshotCorrupt(f"the state has no tensor {key!r}")
        self._read.add(key)
        if found.dtype != dtype or tuple(found.shape) != tuple(shape):
            raise SnapshotCorrupt(
                f"state tensor {key!r} is {_dtype_name(found.dtype)} {list(found.shape)}; "
                f"expected {_dtype_name(dtype)} {list(shape)}"
            )
        return found.to(self.device)

    def rows(self, name: str, dtype: torch.dtype, count: int, row_shape: Sequence[int]):
        """`count` rows [count, *row_shape]: absent where count is 0 (a store that never held
        one) — then None."""
        if count == 0:
            found = self.tensors.get(self.prefix + name)
            if found is not None:
                self._read.add(self.prefix + name)
                if found.numel():
                    raise SnapshotCorrupt(
                        f"state tensor {self.prefix + name!r} holds rows where none are expected"
                    )
            return None
        return self.tensor(name, dtype, (count, *row_shape))

    def token_ids(self, name: str, count: int, vocab: int) -> torch.Tensor:
        """`count` token ids [count] int32, each below `vocab`."""
        ids = self.tensor(name, torch.int32, (count,))
        if count and not bool(((ids >= 0) & (ids < vocab)).all()):
            raise SnapshotCorrupt(
                f"state tensor {self.prefix + name!r} holds token ids outside 0..{vocab - 1}"
            )
        return ids

    def row_count(self, name: str, least: int, most: int) -> int:
        """How many rows tensor `name` holds (0 where it is absent), which must be in
        least..most; its dtype and row shape are checked when it is read."""
        found = self.tensors.get(self.prefix + name)
        count = 0 if found is None or found.dim() == 0 else int(found.shape[0])
        if not least <= count <= most:
            raise SnapshotCorrupt(
                f"state tensor {self.prefix + name!r} holds {count} rows, not {least}..{most}"
            )
        return count

    # ------------------------------------------------------------------ the end

    def finish(self) -> None:
        """Refuse anything the engine did not read."""
        left = sorted(
            (set(self.fields) | set(self.tensors)) - self._read, key=lambda key: (len(key), key)
        )
        if left:
            more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
            raise SnapshotCorrupt(f"the state holds {left[0]!r}{more}, which this engine does not")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
