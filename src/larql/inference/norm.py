"""RMS norm as every layer of every architecture applies it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from larql.kernels import elementwise_kernels

LOW_PRECISION = (torch.float16, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.device.type == "meta":  # `larql memory`: the shape and dtype, without torch's meta rules
        return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))
    if x.dtype in LOW_PRECISION:
        # As the reference implementations do: statistics in float32, the normalised row rounded
        # to the model's dtype, then × weight. Folding the weight into the fused kernel (one
        # rounding instead of two) put bf16 SmolLM2's prefill logits 4.5e-2 from float32's
        # instead of 1.4e-2 (docs/PERFORMANCE.md). On CUDA both roundings in one launch.
        if (kernels := elementwise_kernels(x)) is not None:
            return kernels.rms_norm(x, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), None, eps) * weight
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
