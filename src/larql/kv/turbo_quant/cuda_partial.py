"""turbo-quant's partial attention launch in CUDA C++ (`partial.cu`), compiled at first use with
NVRTC through torch (`torch.cuda._compile_kernel`: torch's CUDA wheels carry libnvrtc).

It replaces two of the Triton launches of a layer's step — the queries' rotation and the partial
launch — with one, writing the split and exact-rows states where the Triton combine launch reads
them. On an H200 its coded rows run ~1.5× faster than the Triton partial launch's at depth
32,000 (docs/PERFORMANCE.md): Triton has no per-lane loads from shared memory, so its
loop decodes each code byte with a dozen integer instructions where this one uses a table
lookup.

It covers the common case, and the Triton launches every other: 4-bit codes, head width 64,
bfloat16 queries and exact rows, at most 8 query heads a K/V head, no soft cap, full-attention
layers (a sliding layer's ring of slots stays on Triton), the recent rows at 16 bits. Where
NVRTC or the device cannot build it, the Triton launches run, and `unavailable()` says why.
The spec `turbo-quant:attention=triton` keeps every step on the Triton launches (to compare the
two).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("partial.cu")
WARPS = 8  # a CTA's (the source's W)
GROUP_ROWS = 32  # rows a warp loads at once (the source's GROUP)
STATE_ROWS = 8  # query rows a warp's state holds (the source's GP)
HEAD_DIM = 64
MAX_GROUP = 8  # query heads a K/V head: the products' 8 columns
TABLE_BYTES = 256 * 256  # the codebook table, one copy per lane
LUT_BASE = 1024  # the table's address in the shared window (sm_80 on reserve the first 1 KB)
TARGET_CTAS = 128  # split CTAs a launch aims at (one an SM on an H200's 132)
MAX_SPLITS = 64  # the workspace's states a (sequence, K/V head), less the exact rows'


def shared_bytes() -> int:
    """The table, then the queries as loaded and rotated, shifts and the warps' states."""
    d, gp, w = HEAD_DIM, STATE_ROWS, WARPS
    return TABLE_BYTES + 4 * (gp * d // 2 + gp * d + gp + 2 * w * gp + w * gp * d)


@dataclass(frozen=True)
class Config:
    """What a compiled kernel is specialised for (one per engine configuration and model)."""

    kv_heads: int
    group: int
    sinks: int
    recent: int
    ring: int  # ring_slots(recent)
    center: bool
    state_rows: int  # query rows a workspace state holds (≥ group)

    def defines(self) -> list[str]:
        return [
            f"-DHKV={self.kv_heads}",
            f"-DG={self.group}",
            f"-DSR={self.state_rows}",
            f"-DSINKS={self.sinks}",
            f"-DRECENT={self.recent}",
            f"-DRING={self.ring}",
            f"-DCENTER={int(self.center)}",
            f"-DLUT_BASE={LUT_BASE}",
        ]


_compiled: dict[tuple[int, Config], object] = {}
_failure: list[str] = []  # why the kernel cannot run here (empty: it can, or not yet tried)


def unavailable() -> str | None:
    """Why the CUDA launch could not be built on this machine (None: it was, or not tried)."""
    return _failure[0] if _failure else None


def splits(max_slots: int, pairs: int) -> int:
    """Split CTAs a (sequence, K/V head) for `pairs` of them over stores of up to `max_slots`
    slots: about TARGET_CTAS in all, none with less than a load group a warp. Each session's
    coded rows are shared out evenly among them at run time, whatever its store's capacity."""
    wanted = max(1, min(MAX_SPLITS, TARGET_CTAS // max(1, pairs)))
    return max(1, min(wanted, -(-max_slots // (WARPS * GROUP_ROWS))))


def kernel(config: Config, device: torch.device) -> object | None:
    """The kernel compiled for `config` on `device` (compiled and checked at first use), or
    None where it cannot be built (then `unavailable()` says why)."""
    key = (device.index or 0, config)
    if key in _compiled:
        return _compiled[key]
    if _failure or torch.cuda.is_current_stream_capturing():
        return None  # (a capture is preceded by a warm-up step, which compiles)
    try:
        with torch.cuda.device(device):
            compiled = torch.cuda._compile_kernel(
                SOURCE.read_text(),
                "turbo_quant_partial",
                nvcc_options=["-std=c++17", "--use_fast_math", *config.defines()],
            )
            compiled.set_shared_memory_config(shared_bytes())
            _check_table_address(compiled, device)
    except (RuntimeError, OSError, AttributeError) as error:
        _failure.append(f"the CUDA partial launch could not be built: {error}")
        return None
    _compiled[key] = compiled
    return compiled


def _check_table_address(compiled: object, device: torch.device) -> None:
    """The table loads carry its shared address as an immediate: the kernel reports where
    its dynamic shared memory really starts (ns < 0), and it must be LUT_BASE."""
    base = torch.zeros(1, dtype=torch.int32, device=device)
    null = torch.zeros(1, dtype=torch.int64, device=device)
    args = [null] * 13 + [-1, 0, 0.0, base]
    compiled(grid=(1, 1, 1), block=(WARPS * 32, 1, 1), args=args, shared_mem=shared_bytes())
    where = int(base.item())
    if where != LUT_BASE:
        raise RuntimeError(f"its shared memory starts at {where}, not {LUT_BASE}")


def launch(
    compiled: object,
    q: torch.Tensor,
    rotation: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    codes: torch.Tensor,
    exact: torch.Tensor,
    centroids: torch.Tensor,
    mean_rotated: torch.Tensor,
    meta: torch.Tensor,
    positions: torch.Tensor,
    m: torch.Tensor,
    l_sum: torch.Tensor,
    acc: torch.Tensor,
    n_splits: int,
    keep: int,
    scale: float,
) -> None:
    """The split and exact-rows states of B sessions' layer (q [B, Hq, 64] bfloat16; k_new,
    v_new [B, Hkv, 64] bfloat16; the state bases and `meta` as the Triton partial launch takes
    them) into the workspace's m, l [B·Hkv, n_splits + 1, SR] and acc [..., SR, 64]."""
    batch, kv_heads = k_new.shape[0], k_new.shape[1]
    base = m  # (unwritten unless n_splits < 0)
    compiled(  # type: ignore[operator]
        grid=(kv_heads, n_splits + 1, batch),
        block=(WARPS * 32, 1, 1),
        args=[
            q,
            rotation,
            k_new,
            v_new,
            codes,
            exact,
            centroids,
            mean_rotated,
            meta,
            positions,
            m,
            l_sum,
            acc,
            n_splits,
            keep,
            float(scale),
            base,
        ],
        shared_mem=shared_bytes(),
    )
