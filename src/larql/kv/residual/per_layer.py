"""`boundary-per-layer`: markov-rs-codec with a per-layer codec policy that must be calibrated.

The policy (v1: bf16 on every layer) defaults to the model's depth; it and its calibration record
are resolved against the model at build time when the model is known, else at prefill, and every
refusal is a typed `EngineBuildError`. Evicted rows get K/V recomputed from their stored rows at
the true position of the first evicted row, extending the cold K/V in place — never invalidated.
"""

from __future__ import annotations

from larql.kv.residual.engine import ResidualStreamEngine
from larql.kv.residual.policy import (
    DEFAULT_KL_BUDGET_NATS,
    BoundaryCalibrationRecord,
    BoundaryLayerPolicy,
    CalibrationBudgetExceeded,
    CalibrationStore,
    default_calibration_store,
    model_revision,
)
from larql.models.model import Model


class BoundaryPerLayerEngine(ResidualStreamEngine):
    name = "boundary-per-layer"

    def __init__(
        self,
        window: int | None = None,
        layers: int | None = None,
        profiling: bool = False,
        model: Model | None = None,
        policy: BoundaryLayerPolicy | None = None,
        calibration: CalibrationStore | None = None,
        kl_budget_nats: float = DEFAULT_KL_BUDGET_NATS,
    ) -> None:
        """`layers` sizes the default uniform bf16 policy (None = the model's depth); an
        explicit `policy` replaces it. Without a `calibration` store, one holding the bf16
        uniform default record for the model is used."""
        self.layers = layers
        self._given_policy = policy
        self._calibration = calibration
        self.kl_budget_nats = kl_budget_nats
        self.policy: BoundaryLayerPolicy | None = None
        self.calibration_record: BoundaryCalibrationRecord | None = None
        super().__init__(window, profiling, model)

    def validate_for(self, model: Model) -> None:
        super().validate_for(model)
        policy = self._given_policy
        if policy is None:
            policy = BoundaryLayerPolicy.uniform(
                model_revision(model), self.layers or model.config.num_layers
            )
        policy.validate_for(model)
        store = self._calibration
        if store is None:  # an empty store is falsy: compare with None
            store = default_calibration_store(model)
        record = store.get(policy.fingerprint())
        if record.kl_bound_nats > self.kl_budget_nats:
            raise CalibrationBudgetExceeded(
                policy.fingerprint(), record.kl_bound_nats, self.kl_budget_nats
            )
        self.policy, self.calibration_record = policy, record

    def codec_labels(self, model: Model) -> list[str]:
        if self.policy is None:  # built without the model: resolved against it now
            self.validate_for(model)
        assert self.policy is not None
        return list(self.policy.entries)

    def fingerprint(self) -> str | None:
        return self.policy.fingerprint() if self.policy is not None else None

    def describe(self) -> str:
        bound = (
            self.calibration_record.kl_bound_nats
            if self.calibration_record is not None
            else self.kl_budget_nats
        )
        return f"per-layer codec policy on cold tier (kl_bound={bound:.3f} nats)"

    def config(self) -> str:
        if self.policy is not None:
            layers: int | str = len(self.policy.entries)
        else:
            layers = self.layers if self.layers is not None else "model"
        return f"{super().config()},layers={layers}"
