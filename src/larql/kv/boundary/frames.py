"""What a boundary frame is: the residual at the end of a chunk of tokens plus what a later
reader needs to trust it — which model produced it, how confident the model was there, whether
the compressed residual still predicts the same token, and how the payload is encoded.

A version-3 frame also carries the token ids of its chunk, so a sequence's chain of frames holds
every token up to its last frame and can be re-run (`larql.kv.boundary.resume`).

Frames are plain data; `to_json` / `from_json` give the metadata document the directory archive
stores next to the payload bytes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import torch

from larql.errors import LarqlError
from larql.kv.boundary import codecs

# 2 added `run_id` (version 1 frames read with run_id ""); 3 added `token_ids` (versions 1 and 2
# read with None: they cannot be resumed)
FRAME_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
TOKEN_IDS_SINCE = 3


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
    # the chunk's token ids, token_end − token_start of them (None: a frame of version < 3)
    token_ids: tuple[int, ...] | None = None

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
        if self.token_ids is None:
            del doc["token_ids"]
        else:
            doc["token_ids"] = list(self.token_ids)
        return doc

    @classmethod
    def from_json(cls, doc: Any, payload: bytes) -> BoundaryFrame:
        """A frame from its stored metadata document (any JSON value: a file's) and payload;
        every field is checked for its type and the payload against its codec and width."""
        doc = _Doc(doc, "the frame")
        version = doc.integer("version")
        if version not in READABLE_VERSIONS:
            raise BoundaryFormatError(
                f"frame version {version} is not supported (this larql reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))})"
            )
        identity = doc.sub("identity")
        meta = doc.sub("metadata")
        info = doc.sub("payload")
        hidden_size = doc.integer("hidden_size", low=1)
        token_start, token_end = doc.integer("token_start"), doc.integer("token_end")
        if token_start > token_end:
            raise BoundaryFormatError(f"token_start {token_start} is past token_end {token_end}")
        codec = info.choice("codec", (*codecs.CODECS, "none"))
        if info.integer("bytes") != len(payload):
            raise BoundaryFormatError(
                f"payload is {len(payload)} bytes, metadata says {info.integer('bytes')}"
            )
        expected = _PAYLOAD_BYTES[codec](hidden_size)
        if expected is not None and len(payload) != expected:
            raise BoundaryFormatError(
                f"a {codec} payload of {len(payload)} bytes for hidden_size {hidden_size} "
                f"(expected {expected})"
            )
        return cls(
            version=version,
            identity=BoundaryModelIdentity(*(identity.text(k) for k in _IDENTITY_FIELDS)),
            sequence_id=doc.text("sequence_id"),
            boundary_id=doc.text("boundary_id"),
            token_start=token_start,
            token_end=token_end,
            layer=doc.integer("layer"),
            hidden_size=hidden_size,
            metadata=BoundaryMetadata(
                top1_token_id=meta.integer("top1_token_id"),
                top1_logit=meta.number("top1_logit"),
                top2_token_id=meta.integer("top2_token_id"),
                top2_logit=meta.number("top2_logit"),
                raw_logit_margin=meta.number("raw_logit_margin"),
                raw_log_prob_margin=meta.number("raw_log_prob_margin"),
                raw_top1_prob=meta.number("raw_top1_prob"),
                agreement=Agreement(meta.choice("agreement", [a.value for a in Agreement])),
                codec_fragile=meta.flag("codec_fragile"),
                boundary_fragile=meta.flag("boundary_fragile"),
                top1_text=meta.text("top1_text", ""),
            ),
            payload=BoundaryPayload(
                codec,
                payload,
                PayloadContract(info.choice("contract", [c.value for c in PayloadContract])),
            ),
            fallback_policy=doc.text("fallback_policy", "cold_replay"),
            run_id=doc.text("run_id", ""),
            token_ids=doc.token_ids("token_ids", token_end - token_start)
            if version >= TOKEN_IDS_SINCE
            else None,
        )


_IDENTITY_FIELDS = ("model_id", "model_revision", "tokenizer_revision", "architecture")
# payload bytes of each codec for a row of `hidden_size` (None: any)
_PAYLOAD_BYTES: dict[str, Callable[[int], int | None]] = {
    "bf16": lambda hidden: 2 * hidden,
    "int8_clip3sigma": lambda hidden: 4 + hidden,
    "none": lambda hidden: None,
}


class _Doc:
    """Typed reads of a frame's JSON metadata; a wrong or missing field is a
    `BoundaryFormatError` naming it."""

    def __init__(self, doc: Any, where: str) -> None:
        if not isinstance(doc, dict):
            raise BoundaryFormatError(f"{where} is not a JSON object")
        self.doc, self.where = doc, where

    def _get(self, key: str, default: Any) -> Any:
        if key in self.doc:
            return self.doc[key]
        if default is _MISSING:
            raise BoundaryFormatError(f"{self.where} has no {key!r}")
        return default

    def _wrong(self, key: str, accepted: str) -> BoundaryFormatError:
        value = repr(self.doc[key])
        shown = value if len(value) <= 40 else value[:37] + "..."
        return BoundaryFormatError(f"{self.where}: {key!r} is {shown}, expected {accepted}")

    def sub(self, key: str) -> _Doc:
        return _Doc(self._get(key, _MISSING), f"{self.where}'s {key!r}")

    def integer(self, key: str, low: int = 0) -> int:
        value = self._get(key, _MISSING)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise self._wrong(key, f"an integer ≥ {low}")
        return value

    def number(self, key: str) -> float:
        value = self._get(key, _MISSING)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self._wrong(key, "a number")
        return float(value)

    def flag(self, key: str) -> bool:
        value = self._get(key, _MISSING)
        if not isinstance(value, bool):
            raise self._wrong(key, "true or false")
        return value

    def text(self, key: str, default: Any = None) -> str:
        value = self._get(key, _MISSING if default is None else default)
        if not isinstance(value, str):
            raise self._wrong(key, "a string")
        return value

    def token_ids(self, key: str, count: int) -> tuple[int, ...]:
        """Exactly `count` integers ≥ 0 (the vocabulary is the reader's to check)."""
        value = self._get(key, _MISSING)
        if (
            not isinstance(value, list)
            or len(value) != count
            or not all(type(t) is int and t >= 0 for t in value)
        ):
            raise BoundaryFormatError(
                f"{self.where}: {key!r} must list the chunk's {count} token ids (integers ≥ 0)"
            )
        return tuple(value)

    def choice(self, key: str, accepted: Sequence[str]) -> str:
        value = self._get(key, _MISSING)
        if not isinstance(value, str) or value not in accepted:
            raise self._wrong(key, f"one of {', '.join(accepted)}")
        return value


_MISSING: Any = object()
