"""What a boundary frame is: the residual at the end of a chunk of tokens plus what a later
reader needs to trust it — which model produced it, how confident the model was there, whether
the compressed residual still predicts the same token, and how the payload is encoded.

Frames are plain data; `to_json` / `from_json` give the metadata document the directory archive
stores next to the payload bytes."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import torch

from larql.errors import LarqlError
from larql.kv.boundary import codecs

FRAME_VERSION = 2  # 2 added `run_id`; version 1 frames still read (their run_id is "")
READABLE_VERSIONS = (1, 2)


class BoundaryFormatError(LarqlError):
    """A stored frame that cannot be read back (wrong version, missing fields, bad payload)."""


class Agreement(StrEnum):
    """Does the int8-round-tripped residual predict the same top-1 token as the raw one?"""

    AGREES = "agrees"
    DISAGREES = "disagrees"
    NOT_CHECKED = "not_checked"


class PayloadContract(StrEnum):
    """What a payload promises: `calibrating` (bf16 while the gate gathers evidence),
    `top1_preserved` (int8, checked to keep the top-1 token), `unknown` (no payload)."""

    CALIBRATING = "calibrating"
    TOP1_PRESERVED = "top1_preserved"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class BoundaryModelIdentity:
    model_id: str
    model_revision: str
    tokenizer_revision: str
    architecture: str

    @classmethod
    def placeholder(cls, model_id: str) -> BoundaryModelIdentity:
        return cls(model_id, "unknown", "unknown", "unknown")


@dataclass(frozen=True)
class BoundaryMetadata:
    """How the model stood at the boundary, from the raw (un-encoded) residual's logits."""

    top1_token_id: int
    top1_logit: float
    top2_token_id: int
    top2_logit: float
    raw_logit_margin: float  # top-1 logit − top-2 logit
    raw_log_prob_margin: float  # log-softmax(top-1) − log-softmax(top-2)
    raw_top1_prob: float
    agreement: Agreement
    codec_fragile: bool  # the int8 round trip changed the top-1 token
    boundary_fragile: bool  # the gate's low-confidence test (see gate.py)
    top1_text: str = ""


@dataclass(frozen=True)
class BoundaryPayload:
    codec: str  # "bf16", "int8_clip3sigma" or "none"
    data: bytes
    contract: PayloadContract

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class BoundaryFrame:
    version: int
    identity: BoundaryModelIdentity
    sequence_id: str
    boundary_id: str  # "{sequence_id}:{token_end}"
    token_start: int  # first absolute position of the chunk
    token_end: int  # one past the last; the residual is the hidden at token_end − 1
    layer: int  # the residual is the output of this layer (the last), before the final norm
    hidden_size: int
    metadata: BoundaryMetadata
    payload: BoundaryPayload
    fallback_policy: str = "cold_replay"  # what a reader does without a usable payload
    run_id: str = ""  # the engine run that wrote the frame

    def residual(self) -> torch.Tensor:
        """The decoded residual, float32 [hidden_size]."""
        if self.payload.codec == "none":
            raise BoundaryFormatError(f"frame {self.boundary_id} carries no residual payload")
        return codecs.decode(self.payload.codec, self.payload.data, self.hidden_size)

    def to_json(self) -> dict[str, Any]:
        """Everything but the payload bytes (those are stored as a tensor)."""
        doc = asdict(self)
        payload = doc.pop("payload")
        doc["payload"] = {
            "codec": payload["codec"],
            "contract": self.payload.contract.value,
            "bytes": self.payload.nbytes,
        }
        doc["metadata"]["agreement"] = self.metadata.agreement.value
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any], payload: bytes) -> BoundaryFrame:
        try:
            if doc["version"] not in READABLE_VERSIONS:
                raise BoundaryFormatError(
                    f"frame version {doc['version']} is not supported (this larql reads "
                    f"versions {', '.join(map(str, READABLE_VERSIONS))})"
                )
            meta = dict(doc["metadata"])
            meta["agreement"] = Agreement(meta["agreement"])
            info = doc["payload"]
            if info["bytes"] != len(payload):
                raise BoundaryFormatError(
                    f"frame {doc['boundary_id']}: payload is {len(payload)} bytes, "
                    f"metadata says {info['bytes']}"
                )
            return cls(
                version=doc["version"],
                identity=BoundaryModelIdentity(**doc["identity"]),
                sequence_id=doc["sequence_id"],
                boundary_id=doc["boundary_id"],
                token_start=doc["token_start"],
                token_end=doc["token_end"],
                layer=doc["layer"],
                hidden_size=doc["hidden_size"],
                metadata=BoundaryMetadata(**meta),
                payload=BoundaryPayload(info["codec"], payload, PayloadContract(info["contract"])),
                fallback_policy=doc.get("fallback_policy", "cold_replay"),
                run_id=doc.get("run_id", ""),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise BoundaryFormatError(f"malformed boundary frame metadata: {e!r}") from None
