"""turbo-quant with uniform 4-bit levels instead of Lloyd–Max: what a codebook whose decode is an
integer→float conversion (no table lookup) would cost in fidelity.

The levels are c_i = (i − 7.5)·step (step 0.3352: the MSE-optimal uniform 16-level quantiser of
N(0, 1)), the boundaries their midpoints; everything else is `benchmarks/kv_quant_levers.py`
with the same arguments.

    .venv/bin/python benchmarks/uniform_codebook.py 0.3352 "turbo-quant"
"""

from __future__ import annotations

import runpy
import sys
from itertools import pairwise
from pathlib import Path

import larql.kv.turbo_quant.codebook as codebook_module

LEVELS = 16


def main() -> None:
    step = float(sys.argv[1])
    lloyd_max = codebook_module.standard_normal_lloyd_max

    def levels(bits: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        if bits != 4:
            return lloyd_max(bits)
        centroids = tuple((i - (LEVELS - 1) / 2) * step for i in range(LEVELS))
        return centroids, tuple(0.5 * (a + b) for a, b in pairwise(centroids))

    codebook_module.standard_normal_lloyd_max = levels  # read when a codebook is first built
    sys.argv = ["kv_quant_levers.py", *sys.argv[2:]]
    runpy.run_path(str(Path(__file__).with_name("kv_quant_levers.py")), run_name="__main__")


if __name__ == "__main__":
    main()
