"""Old names of renamed keyword arguments: still accepted, with a `DeprecationWarning` naming
the new one, so code written against an older larql keeps working while the API speaks the
CLI's vocabulary (`prompt_tokens` for a prompt's length, `max_new_tokens` for new tokens,
`ffn_policy` for the FFN policy — `--prompt-tokens`, `-n/--max-tokens`, `--ffn-policy`)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from larql.errors import InvalidInput

P = ParamSpec("P")
R = TypeVar("R")


def renamed_arguments(**new_of_old: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """`@renamed_arguments(context="prompt_tokens")`: a call that passes `context=` gets it as
    `prompt_tokens=` (with a warning); one that passes both is refused."""

    def wrap(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            for old, new in new_of_old.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise InvalidInput(
                        f"{function.__name__}: give {new}= only ({old}= is its old name)"
                    )
                warnings.warn(
                    f"{function.__name__}({old}=…) is deprecated; use {new}=",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return call

    return wrap
