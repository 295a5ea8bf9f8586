"""Building and loading the CPU decode extension: the block product (`block_dot.h`,
`block_gemv.cpp`) and the decode step's fused layer pieces (`decode_layer.cpp`).

`make setup` builds it (`python -m larql.kernels.cpu.build`) into a folder of the venv keyed
by the source, torch's version and this CPU's instruction-set flags, with `-O3 -march=native`:
the machine that runs it is the one that built it; a build removes the older ones beside it.
At run time `cpu_extension()` imports that build or returns None — it never compiles — and the
callers fall back to torch's float products.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

NAME = "larql_block_gemv"
HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp"))
HEADERS = sorted(HERE.glob("*.h"))
# -fopenmp: at::parallel_for splits the rows over threads only in code built with OpenMP
FLAGS = ["-O3", "-march=native", "-std=c++17", "-fopenmp"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def build_dir() -> Path:
    """Where this source, torch and CPU's build lives."""
    key = hashlib.sha256()
    code = [path.read_bytes() for path in SOURCES + HEADERS]
    parts = (*code, " ".join(FLAGS).encode(), torch.__version__.encode(), _cpu_flags().encode())
    for part in parts:
        key.update(part)
    return Path(sys.prefix) / "share" / "larql-kernels" / key.hexdigest()[:16]


def build(verbose: bool = False) -> ModuleType:
    """Compile the extension into `build_dir()` (needs a C++ compiler and ninja), then remove
    the builds of other sources, torch versions or CPUs beside it (`load` never reads them)."""
    from torch.utils.cpp_extension import load as compile_and_load

    where = build_dir()
    where.mkdir(parents=True, exist_ok=True)
    # the `ninja` package's binary sits beside this interpreter, not always on PATH
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    module = compile_and_load(
        name=NAME,
        sources=[str(path) for path in SOURCES],
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(where),
        verbose=verbose,
    )
    remove_other_builds(where)
    return module


def remove_other_builds(kept: Path) -> list[Path]:
    """Delete the build folders beside `kept` (each ~2 MB, one per source change) → them."""
    others = [path for path in kept.parent.iterdir() if path.is_dir() and path != kept]
    for path in others:
        shutil.rmtree(path, ignore_errors=True)
    return others


# the calls larql makes; a module without one of them is not this source's build
CALLS = (
    "block_gemm",
    "tile_rows",
    "decode_layers_batch",
    "rows_kv",
    "coded_encode",
    "grouped_encode",
    "coded_attention",
    "grouped_attention",
    "decode_layers_coded",
)


@cache
def cpu_extension() -> ModuleType | None:
    """The CPU extension: the one way larql reaches it. None where `make setup` did not build
    it for this machine (or the build lacks a call larql makes): the callers then run torch's
    operators and float products."""
    library = next(build_dir().glob(f"{NAME}*.so"), None) if build_dir().is_dir() else None
    if library is None:
        return None
    spec = importlib.util.spec_from_file_location(NAME, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:
        return None
    return module if all(hasattr(module, call) for call in CALLS) else None


def main() -> None:
    try:
        module = build()
    except Exception as e:  # any compiler failure leaves the torch fallback
        print(f"larql: the CPU block kernels did not build ({type(e).__name__}: {e});")
        print("larql: decode falls back to torch's float products")
        return
    print(f"larql: CPU block kernels built ({module.simd()}) in {build_dir()}")


if __name__ == "__main__":
    main()
