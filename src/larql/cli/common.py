"""What every command shares: typed errors become one clear line and exit code 2, and the
model / engine / prompt options are read the same way everywhere."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import typer
from rich.console import Console

from larql.errors import InvalidInput, LarqlError

if TYPE_CHECKING:  # torch and the models load in the commands' bodies, not for `--help`
    from larql.models.model import Model
    from larql.models.shard import TensorShard

F = TypeVar("F", bound=Callable[..., Any])

stderr = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)
# Piped output gets wide tables instead of rich's 80-column default.
stdout = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 180)

EXIT_USER_ERROR = 2


__all__ = ["InvalidInput", "open_model", "read_prompt", "stderr", "stdout", "user_errors"]


def user_errors(command: F) -> F:
    """Run a command body; a `LarqlError` prints `error: …` on stderr and exits 2; Ctrl-C
    (SIGINT) prints `interrupted` and exits 130, as a shell reports a command it
    interrupted (a command that was writing output ends it first)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except LarqlError as e:
            stderr.print(f"error: {e}")
            raise typer.Exit(EXIT_USER_ERROR) from None
        except KeyboardInterrupt:
            stderr.print("interrupted")
            raise typer.Exit(130) from None
        except BrokenPipeError:
            raise typer.Exit(0) from None

    return wrapper  # type: ignore[return-value]


def read_prompt(prompt: str) -> str:
    """`-` reads the prompt from stdin, without the line ending(s) at its end (as the shell's
    `$(…)` drops them): `echo "Once upon a time" | larql run -` prompts "Once upon a time"."""
    text = sys.stdin.read().rstrip("\r\n") if prompt == "-" else prompt
    if not text.strip():
        raise InvalidInput("the prompt is empty (pass text, or - to read it from stdin)")
    return text


def open_model(
    model: str | None,
    dtype: str,
    device: str,
    threads: int | None = None,
    weights: str = "auto",
    shard: TensorShard | None = None,
) -> Model:
    """The model a command runs; in a tensor-parallel run, this rank's share of it (`shard`,
    else the group this process joined)."""
    from larql.api import load_model
    from larql.parallel.launch import current_shard

    if threads is not None and threads < 1:
        raise InvalidInput(f"--threads must be ≥ 1, got {threads}")
    shard = shard or current_shard()
    if shard is None:
        return load_model(model, dtype=dtype, device=device, weights=weights, threads=threads)
    import torch

    from larql.models.model import load_model as load_share

    if threads is not None:
        torch.set_num_threads(threads)
    return load_share(model, dtype=dtype, device=device, weights=weights, shard=shard)
