"""The greedy pick's kernel (`larql.kernels.argmax`; compiled on CUDA, in Triton's interpreter on
a CPU machine) gives torch's argmax: the first of equal maxima, across the chunks the first
launch splits a row into, with NaN, infinities and signed zeros, in every float dtype."""

from __future__ import annotations

import pytest
import torch

from helpers import kernel_module
from larql.inference.sampling import greedy_token, greedy_tokens
from larql.kernels import argmax_kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def argmax_rows():
    return kernel_module("larql.kernels.argmax").argmax_rows


def _check(argmax_rows, logits: torch.Tensor) -> None:
    got = argmax_rows(logits.to(DEVICE))
    assert got.dtype == torch.int64 and got.shape == (logits.shape[0],)
    assert got.cpu().tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 7, 2048, 2049, 5000])
def test_random_rows_pick_torch_argmax(argmax_rows, dtype, width) -> None:
    generator = torch.Generator().manual_seed(width)
    logits = (4 * torch.randn(3, width, generator=generator)).to(dtype)
    _check(argmax_rows, logits)


def test_equal_maxima_in_different_chunks_pick_the_first(argmax_rows) -> None:
    logits = torch.zeros(4, 6000)
    logits[0, [4100, 2100, 5999]] = 3.0  # the first is in the second chunk
    logits[1, [2047, 2048]] = 1.0  # either side of a chunk's edge
    logits[2, [10, 11, 4096]] = 2.0  # two in one chunk
    logits[3] = -1.0  # every column the same
    _check(argmax_rows, logits)
    assert argmax_rows(logits.to(DEVICE)).cpu().tolist() == [2100, 2047, 10, 0]


def test_nan_infinities_and_signed_zeros_as_torch(argmax_rows) -> None:
    logits = torch.full((6, 4500), -5.0)
    logits[0, [3000, 100]] = float("nan")  # NaN above everything, the first one
    logits[0, 50] = float("inf")
    logits[1, 4000] = float("inf")
    logits[1, 20] = 1e30
    logits[2] = float("-inf")  # nothing above −inf: the first column
    logits[3, 10], logits[3, 9] = 0.0, -0.0  # −0.0 equals +0.0
    logits[4, 2500], logits[4, 3500] = -1e-30, -1e-31  # negatives: the smaller magnitude
    logits[5] = torch.linspace(-3, -1, 4500)  # all negative, the largest at the end
    _check(argmax_rows, logits)


def test_a_strided_row_is_read_as_its_values(argmax_rows) -> None:
    logits = torch.randn(2, 3000, generator=torch.Generator().manual_seed(3))
    columns = logits.t().contiguous().t()  # the same values, the last dim not contiguous
    assert columns.stride(-1) != 1
    _check(argmax_rows, columns)


def test_the_kernel_runs_only_on_cuda_float_rows() -> None:
    assert argmax_kernel(torch.zeros(1, 5)) is None  # the CPU keeps torch / numpy
    if torch.cuda.is_available():
        assert argmax_kernel(torch.zeros(1, 5, device="cuda")) is not None
        assert argmax_kernel(torch.zeros(1, 5, device="cuda", dtype=torch.float64)) is None
        assert argmax_kernel(torch.zeros(5, device="cuda")) is None


def test_the_samplers_greedy_pick_goes_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel runs, `greedy_tokens` (and so the bench's and the server's greedy pick)
    calls it; elsewhere torch's argmax."""
    import larql.inference.sampling as sampling

    calls = []

    def counted(logits: torch.Tensor) -> torch.Tensor:
        calls.append(logits.shape)
        return logits.argmax(-1)

    monkeypatch.setattr(sampling, "argmax_kernel", lambda logits: counted)
    logits = torch.randn(2, 300)
    assert greedy_tokens(logits).tolist() == logits.argmax(-1).tolist()
    assert int(greedy_token(logits[1])) == int(logits[1].argmax())
    assert calls == [(2, 300), (1, 300)]
