"""K/V shared across layers (Gemma 4's last `num_kv_shared_layers` layers): such a layer keeps
no K/V of its own and attends over the keys and values its source layer — the last earlier
layer of its kind — attended over in the same forward step. An engine makes one `SharedKv` per
step; the source layer's attention `keep`s what it attended over (after the engine's own
policy: a window, a codec's basis, evicted rows), and each sharing layer reads it with `of`.
So a sharing layer costs no state in any engine, and sees exactly what its source saw."""

from __future__ import annotations

import torch

from larql.inference.errors import InvariantViolation
from larql.models.config import ModelConfig

# keys, values [Hkv, T, D] and the optional `allowed` mask [S, T] they were attended with
Attended = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


class SharedKv:
    """What each K/V source layer attended over in one forward step."""

    def __init__(self, config: ModelConfig) -> None:
        self._config = config
        self._sources = {config.kv_source_of(i) for i in range(config.num_layers)} - {None}
        self._held: dict[int, Attended] = {}

    def keep(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        allowed: torch.Tensor | None = None,
    ) -> None:
        """Layer `layer` attended over keys/values [Hkv, T, D] (`allowed` [S, T] or None)."""
        if layer in self._sources:
            self._held[layer] = (keys, values, allowed)

    def is_source(self, layer: int) -> bool:
        """Whether a later layer attends over what `layer` attends over (it must `keep` it)."""
        return layer in self._sources

    def of(self, layer: int) -> Attended:
        """What the source of sharing layer `layer` attended over in this step."""
        source = self._config.kv_source_of(layer)
        if source is None or source not in self._held:
            raise InvariantViolation(
                f"layer {layer} shares layer {source}'s K/V, which did not attend in this step"
            )
        return self._held[source]


def shares(config: ModelConfig, layer: int) -> bool:
    """Whether `layer` attends over another layer's K/V (and keeps none)."""
    return config.kv_source_of(layer) is not None
