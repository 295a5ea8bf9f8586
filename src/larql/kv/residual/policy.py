"""Per-layer cold-codec policies and their calibration records.

A `BoundaryLayerPolicy` names one codec per layer for one model revision; its fingerprint
(`"{model_revision}|0=bf16,1=bf16,…"`) is the key under which a `BoundaryCalibrationRecord`
states the KL bound measured for it on a corpus. An engine refuses — with typed errors the CLI
reports like any other build error — a policy with a codec it cannot run, a policy whose layer
count is not the model's, a policy made for another model, and a policy nobody calibrated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from larql.kv.residual.codecs import Bf16Codec
from larql.kv.spec import EngineBuildError
from larql.models.model import Model

SUPPORTED_LAYER_CODECS = (Bf16Codec.label,)  # v1: bf16 on every layer
DEFAULT_KL_BUDGET_NATS = 0.01


class BoundaryPolicyError(EngineBuildError):
    """A per-layer codec policy this engine cannot run for this model."""


class UnsupportedCodec(BoundaryPolicyError):
    def __init__(self, layer: int, codec: str) -> None:
        super().__init__(
            f"boundary-per-layer: layer {layer} asks for codec {codec!r}; "
            f"supported per-layer codecs: {', '.join(SUPPORTED_LAYER_CODECS)}"
        )
        self.layer, self.codec = layer, codec


class LayerCountMismatch(BoundaryPolicyError):
    def __init__(self, policy_layers: int, model_layers: int) -> None:
        super().__init__(
            f"boundary-per-layer: the policy has {policy_layers} layers but the model has "
            f"{model_layers}; use layers={model_layers} or leave layers out"
        )
        self.policy_layers, self.model_layers = policy_layers, model_layers


class PolicyModelMismatch(BoundaryPolicyError):
    def __init__(self, policy_revision: str, model_revision: str) -> None:
        super().__init__(
            f"boundary-per-layer: the policy was made for {policy_revision!r}, "
            f"not for {model_revision!r}"
        )


class CalibrationError(EngineBuildError):
    """The calibration store cannot vouch for a policy."""


class NoCalibrationRecord(CalibrationError):
    def __init__(self, fingerprint: str) -> None:
        super().__init__(
            f"boundary-per-layer: no calibration record for policy {fingerprint!r}; "
            "calibrate the policy and put its record in the store first"
        )
        self.fingerprint = fingerprint


class CalibrationBudgetExceeded(CalibrationError):
    def __init__(self, fingerprint: str, bound: float, budget: float) -> None:
        super().__init__(
            f"boundary-per-layer: policy {fingerprint!r} is calibrated to KL ≤ {bound} nats, "
            f"above the budget of {budget} nats"
        )


def model_revision(model: Model) -> str:
    """What a policy is tied to: the model's registry name (or its config's)."""
    return model.name or model.config.name


@dataclass(frozen=True)
class BoundaryLayerPolicy:
    model_revision: str
    entries: tuple[str, ...]  # codec label of layer 0, 1, …

    @classmethod
    def uniform(
        cls, revision: str, layers: int, codec: str = Bf16Codec.label
    ) -> BoundaryLayerPolicy:
        return cls(revision, (codec,) * layers)

    def fingerprint(self) -> str:
        layers = ",".join(f"{i}={codec}" for i, codec in enumerate(self.entries))
        return f"{self.model_revision}|{layers}"

    def validate_for(self, model: Model) -> None:
        """Refusal rules, in order: unsupported codec, layer count, model revision."""
        for layer, codec in enumerate(self.entries):
            if codec not in SUPPORTED_LAYER_CODECS:
                raise UnsupportedCodec(layer, codec)
        if len(self.entries) != model.config.num_layers:
            raise LayerCountMismatch(len(self.entries), model.config.num_layers)
        if self.model_revision != model_revision(model):
            raise PolicyModelMismatch(self.model_revision, model_revision(model))


@dataclass(frozen=True)
class BoundaryCalibrationRecord:
    policy_fingerprint: str
    corpus_id: str
    kl_bound_nats: float
    samples: int

    @classmethod
    def bf16_uniform_default(cls, policy: BoundaryLayerPolicy) -> BoundaryCalibrationRecord:
        """bf16 everywhere needs no measured corpus: the pre-registered 0.01-nat bound."""
        return cls(policy.fingerprint(), "bf16-trivial", DEFAULT_KL_BUDGET_NATS, 0)


class CalibrationStore(Protocol):
    def put(self, record: BoundaryCalibrationRecord) -> None: ...

    def get(self, fingerprint: str) -> BoundaryCalibrationRecord:
        """The record for a policy fingerprint; `NoCalibrationRecord` if there is none."""
        ...


class InMemoryCalibrationStore:
    def __init__(self, records: Sequence[BoundaryCalibrationRecord] = ()) -> None:
        self._records = {r.policy_fingerprint: r for r in records}

    def put(self, record: BoundaryCalibrationRecord) -> None:
        self._records[record.policy_fingerprint] = record

    def get(self, fingerprint: str) -> BoundaryCalibrationRecord:
        try:
            return self._records[fingerprint]
        except KeyError:
            raise NoCalibrationRecord(fingerprint) from None

    def __len__(self) -> int:
        return len(self._records)


def default_calibration_store(model: Model) -> InMemoryCalibrationStore:
    """A store holding only the bf16-uniform default record for `model`."""
    policy = BoundaryLayerPolicy.uniform(model_revision(model), model.config.num_layers)
    return InMemoryCalibrationStore([BoundaryCalibrationRecord.bf16_uniform_default(policy)])
