"""Sampling on a tensor-parallel rank: every rank computes the same logits, rank 0 draws and
the others take its token, so a sampled (not only a greedy) generation feeds every rank the
same tokens."""

from __future__ import annotations

import torch

from larql.inference.sampling import Sampler
from larql.models.shard import TensorShard


class AgreedSampler(Sampler):
    """`sampler`'s picks, rank 0's on every rank of `shard`."""

    def __init__(self, sampler: Sampler, shard: TensorShard) -> None:
        self.params = sampler.params
        self._inner = sampler
        self._shard = shard

    def pick(self, logits: torch.Tensor) -> int:
        return self._shard.agree(self._inner.pick(logits))

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        return self._inner.distribution(logits)
