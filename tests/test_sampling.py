"""Greedy picks: numpy's argmax on the CPU gives torch's answer, ties and all."""

from __future__ import annotations

import pytest
import torch

from larql.inference.sampling import Sampler, greedy_picks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_greedy_picks_are_torch_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[3, 17] = logits[3, 900] = logits[3].max() + 1  # a tie: the first index wins
    logits[5] = 0.0  # all equal
    picks = greedy_picks(logits)
    assert picks == logits.argmax(-1).tolist()
    assert picks[3] == 17 and picks[5] == 0
    strided = logits[:, ::3]  # not contiguous
    assert greedy_picks(strided) == strided.argmax(-1).tolist()


def test_a_greedy_sampler_picks_the_first_maximum() -> None:
    row = torch.tensor([0.5, 2.0, -1.0, 2.0])
    assert Sampler().pick(row) == 1
