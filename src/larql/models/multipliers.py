"""Granite's scalar multipliers that the loaders fold into the weights, so the forward pass
never sees them: the residual multiplier m into every matrix whose output is added to the
residual (h + m·W·x = h + (m·W)·x), the logits' divisor into the final norm's weight (the LM
head is linear). (The embedding and attention multipliers are config fields the forward pass
reads.) Both loaders, HF and GGUF, use these."""

from __future__ import annotations

import torch

from larql.models.config import Arch, ModelConfig
from larql.models.errors import UnsupportedArchitecture

# the canonical weights whose output joins the residual stream
INTO_RESIDUAL = ("wo", "bo", "w_down", "experts_down", "shared_down")


def multiplier_folds(residual: float, logits_divisor: float, arch: Arch) -> dict[str, object]:
    """The folds a model needs, for `ModelConfig.extra` (none when both are 1)."""
    folds: dict[str, object] = {}
    if residual != 1.0:
        if arch.post_norms:
            raise UnsupportedArchitecture("a residual multiplier with post-norms is not supported")
        folds["residual_multiplier"] = residual
    if logits_divisor != 1.0:
        folds["logits_scaling"] = logits_divisor
    return folds


def folds_residual(config: ModelConfig) -> bool:
    """Whether the matrices of `INTO_RESIDUAL` are scaled at load (so a file's quantised blocks
    of them are not the weights the model uses)."""
    return isinstance(config.extra.get("residual_multiplier"), float)


def fold_multipliers(state: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Apply `multiplier_folds`' multipliers to the canonical weights, in place."""
    residual = config.extra.get("residual_multiplier")
    if isinstance(residual, float):
        for key in [k for k in state if k.rsplit(".", 1)[-1] in INTO_RESIDUAL]:
            state[key] = state[key] * residual
    divisor = config.extra.get("logits_scaling")
    if isinstance(divisor, float) and "final_norm" in state:  # (its absence is refused later)
        state["final_norm"] = state["final_norm"] / divisor
