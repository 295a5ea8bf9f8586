"""Compile for a GPU the Triton launches a CPU run made in Triton's interpreter.

The interpreter runs a kernel's Python, not its compiler: a kernel can pass every interpreted
test and still fail to compile (a product narrower than the matrix units take, a construct one
Triton version lowers and another refuses). Triton compiles for an sm_90 target on any machine,
so `recorded()` notes each interpreted launch — the kernel, its arguments' types, its
compile-time constants, its launch options — and `compile_failures` compiles each distinct one
for sm_90 in a process without the interpreter (where `triton.jit` builds real kernels).

    python tests/kernel_compile.py LAUNCHES.pickle   # what `compile_failures` runs

Another Triton version compiles them where `KERNEL_COMPILE_PATH` names a folder holding it (an
unpacked wheel: `pip download --no-deps triton==3.6.0`, then unzip), put first on the compiling
process's path — the interpreted run keeps the installed one.
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

_POINTERS = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.int16: "*i16",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.bool: "*i1",
}
_OPTIONS = ("num_warps", "num_stages")  # the launch keywords that change the compiled kernel
_ALIGNED = 16  # Triton's specialisation: pointers and integers divisible by 16 are marked so


@dataclass(frozen=True)
class Launch:
    """One kernel specialisation as a GPU launch would compile it."""

    module: str
    name: str
    signature: tuple[tuple[str, str], ...]  # (parameter, Triton type or "constexpr")
    constants: tuple[tuple[str, Any], ...]  # (constexpr parameter, value)
    aligned: tuple[int, ...]  # parameter indices divisible by 16
    options: tuple[tuple[str, int], ...]


def _is_constexpr(parameter: inspect.Parameter) -> bool:
    return "constexpr" in str(parameter.annotation)


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)  # a tl.constexpr's value


def _argument(value: Any) -> tuple[str, bool]:
    """A runtime argument → (its Triton type, whether Triton marks it divisible by 16)."""
    if isinstance(value, torch.Tensor):
        return _POINTERS[value.dtype], value.data_ptr() % _ALIGNED == 0
    if isinstance(value, bool):
        return "i1", False
    if isinstance(value, int):
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), value % _ALIGNED == 0
    if isinstance(value, float):
        return "fp32", False
    raise TypeError(f"an argument of type {type(value).__name__}")


def describe(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Launch:
    """An interpreted launch of the Python function `fn` → the GPU launch's specialisation,
    with programmatic dependent launch on (as on an sm_90 device)."""
    parameters = inspect.signature(fn).parameters
    bound = inspect.signature(fn).bind_partial(
        *args, **{k: v for k, v in kwargs.items() if k in parameters}
    )
    bound.apply_defaults()
    signature, constants, aligned = [], [], []
    for index, (name, parameter) in enumerate(parameters.items()):
        value = _plain(bound.arguments[name])
        if name == "PDL":
            value = True
        if _is_constexpr(parameter) or value is None or (isinstance(value, int) and value == 1):
            signature.append((name, "constexpr"))
            constants.append((name, value))
            continue
        kind, divisible = _argument(value)
        signature.append((name, kind))
        if divisible:
            aligned.append(index)
    options = tuple((k, int(kwargs[k])) for k in _OPTIONS if k in kwargs)
    return Launch(
        fn.__module__, fn.__qualname__, tuple(signature), tuple(constants), tuple(aligned), options
    )


@contextmanager
def recorded() -> Iterator[list[Launch]]:
    """Every launch Triton's interpreter runs inside the block, noted (and run as usual)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: list[Launch] = []
    original = InterpretedFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        launches.append(describe(self.fn, args, kwargs))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        InterpretedFunction.run = original  # type: ignore[method-assign]


def compile_failures(launches: list[Launch], timeout: float = 900.0) -> dict[str, str]:
    """Each distinct launch compiled for sm_90 in a fresh process → {launch: error} for those
    that failed (empty: all compiled)."""
    distinct = list(dict.fromkeys(launches))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "launches.pickle")
        with open(path, "wb") as f:
            pickle.dump(distinct, f)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if os.environ.get("KERNEL_COMPILE_PATH"):
            paths = [os.environ["KERNEL_COMPILE_PATH"], os.environ.get("PYTHONPATH", "")]
            env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        done = subprocess.run(
            [sys.executable, __file__, path],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    if done.returncode != 0:
        return {"the compiling process": done.stderr[-4000:]}
    failures: dict[str, str] = json.loads(done.stdout.splitlines()[-1])
    return failures


def _compile(launch: Launch) -> str | None:
    """Compile one launch for sm_90 → None, or the error's last lines."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        kernel = getattr(importlib.import_module(launch.module), launch.name)
        attributes = {(i,): [["tt.divisibility", _ALIGNED]] for i in launch.aligned}
        source = ASTSource(kernel, dict(launch.signature), dict(launch.constants), attributes)
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(launch.options))
    except Exception as error:  # every failure is reported: where, then why
        where = "\n".join(str(error).splitlines()[-12:])
        causes = []
        cause = error.__cause__
        while cause is not None:
            causes.append(f"{type(cause).__name__}: {cause}")
            cause = cause.__cause__
        return "\n".join([where, *causes])
    return None


def _label(launch: Launch) -> str:
    constants = ", ".join(f"{k}={v!r}" for k, v in launch.constants)
    return f"{launch.module}.{launch.name}({constants}) {dict(launch.options)}"


def main(path: str) -> None:
    with open(path, "rb") as f:
        launches: list[Launch] = pickle.load(f)
    # Triton releases the GIL while it compiles: threads use the cores
    with ThreadPoolExecutor(max_workers=max(1, len(os.sched_getaffinity(0)))) as pool:
        errors = list(pool.map(_compile, launches))
    failures = {
        _label(launch): error for launch, error in zip(launches, errors, strict=True) if error
    }
    print(json.dumps(failures))


if __name__ == "__main__":
    main(sys.argv[1])
