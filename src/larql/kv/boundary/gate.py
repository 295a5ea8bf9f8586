"""The gate that decides how a boundary frame's residual is stored.

In calibration mode (the default, as in the reference) every frame gets a bf16 payload while
evidence accumulates; the confidence test still runs and is recorded. Outside calibration mode
(a policy of ours — the reference leaves it open): a frame whose int8 round trip changed the
top-1 token gets no payload (cold replay), a low-confidence boundary keeps bf16, and a confident
one whose int8 round trip kept the top-1 token is stored as int8."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from larql.kv.boundary.frames import Agreement, PayloadContract


class GateDecision(StrEnum):
    COMPRESSED_OK = "compressed_ok"
    USE_BF16 = "use_bf16"
    COLD_REPLAY = "cold_replay"
    REJECT = "reject"


@dataclass(frozen=True)
class GateConfig:
    calibration_mode: bool = True
    min_log_prob_margin: float = 1.0  # nats between the top-1 and top-2 tokens
    min_top1_prob: float = 0.5

    def boundary_fragile(self, log_prob_margin: float, top1_prob: float) -> bool:
        """A boundary the model was unsure at: a small margin or a top-1 below even odds."""
        return log_prob_margin < self.min_log_prob_margin or top1_prob < self.min_top1_prob

    def decide(self, agreement: Agreement, boundary_fragile: bool) -> GateDecision:
        if self.calibration_mode:
            return GateDecision.USE_BF16
        if agreement is Agreement.DISAGREES:
            return GateDecision.COLD_REPLAY
        if boundary_fragile or agreement is Agreement.NOT_CHECKED:
            return GateDecision.USE_BF16
        return GateDecision.COMPRESSED_OK


def payload_plan(decision: GateDecision) -> tuple[str, PayloadContract]:
    """(codec, contract) of the payload a decision asks for; codec "none" = no payload."""
    if decision is GateDecision.COMPRESSED_OK:
        return "int8_clip3sigma", PayloadContract.TOP1_PRESERVED
    if decision is GateDecision.USE_BF16:
        return "bf16", PayloadContract.CALIBRATING
    return "none", PayloadContract.UNKNOWN
