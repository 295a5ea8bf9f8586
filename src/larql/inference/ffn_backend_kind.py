"""One FFN backend spec — `dense`, `walk[:k=N|none]`, `null`,
`remote-walk:endpoint=URL[,wire=f32|f16|i8]` — parsed strictly (reference §7.3).

Names are case-insensitive and trimmed; a spec is split at the first `:`, its parameters on
`,` and each parameter at the first `=`. A name we do not know is `UnknownBackend`; a known
name with bad parameters is `MalformedBackend`. Both name the accepted forms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from larql.errors import LarqlError

BackendName = Literal["dense", "walk", "remote-walk", "null"]
ALIASES: dict[str, BackendName] = {
    "dense": "dense",
    "weight": "dense",
    "weights": "dense",
    "walk": "walk",
    "remote-walk": "remote-walk",
    "remote_walk": "remote-walk",
    "null": "null",
    "off": "null",
}
SUPPORTED = ("dense", "walk", "remote-walk", "null")
WIRES = ("f32", "f16", "i8")
ACCEPTED = (
    "supported: dense (alias weight, weights), walk[:k=N|none], null (alias off), "
    "remote-walk:endpoint=URL[,wire=f32|f16|i8] (alias remote_walk)"
)
_INTEGER = re.compile(r"[0-9]+")


class FfnPolicyError(LarqlError):
    """An FFN backend spec or per-layer policy that does not parse or does not fit the model."""


class EmptySpec(FfnPolicyError):
    """A policy with nothing in it."""


class UnknownBackend(FfnPolicyError):
    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


class MalformedBackend(FfnPolicyError):
    """A known backend name with parameters that do not parse."""


@dataclass(frozen=True)
class FfnBackendKind:
    kind: BackendName
    k: int | None = None  # walk: features kept per position (None = all, dense-equivalent)
    endpoint: str | None = None  # remote-walk
    wire: str | None = None  # remote-walk: f32 | f16 | i8 (None = f32)

    @classmethod
    def parse(cls, spec: str, context: str | None = None) -> FfnBackendKind:
        """`context` is the binding the spec came from, quoted in error messages."""
        where = f" in `{context}`" if context else ""
        raw_name, _, raw_params = spec.partition(":")
        name = raw_name.strip().lower()
        kind = ALIASES.get(name)
        if kind is None:
            shown = repr(raw_name.strip()) if raw_name.strip() else "an empty name"
            raise UnknownBackend(f"unknown FFN backend {shown}{where}; {ACCEPTED}", name)
        params: dict[str, str] = {}
        for piece in raw_params.split(",") if raw_params.strip() else []:
            key, eq, value = piece.partition("=")
            key = key.strip().lower()
            if not eq or not key:
                raise MalformedBackend(f"{kind}: {piece.strip()!r} is not key=value{where}")
            if key in params:
                raise MalformedBackend(f"{kind}: {key} given twice{where}")
            params[key] = value.strip()
        if kind in ("dense", "null"):
            if params:
                raise MalformedBackend(f"{kind} takes no parameters, got {spec.strip()!r}{where}")
            return cls(kind)
        if kind == "walk":
            return cls("walk", k=_walk_k(params, where))
        return cls("remote-walk", *_remote(params, where))

    def spec(self) -> str:
        """Canonical spec; parsing it gives back an equal kind."""
        if self.kind == "walk":
            return "walk" if self.k is None else f"walk:k={self.k}"
        if self.kind == "remote-walk":
            wire = f",wire={self.wire}" if self.wire else ""
            return f"remote-walk:endpoint={self.endpoint}{wire}"
        return self.kind


def _unknown_keys(kind: str, params: dict[str, str], allowed: tuple[str, ...], where: str) -> None:
    extra = sorted(set(params) - set(allowed))
    if extra:
        raise MalformedBackend(
            f"{kind}: unknown parameter {extra[0]!r}{where}; accepted: {', '.join(allowed)}"
        )


def _walk_k(params: dict[str, str], where: str) -> int | None:
    _unknown_keys("walk", params, ("k",), where)
    raw = params.get("k")
    if raw is None or raw.lower() == "none":
        return None
    if not _INTEGER.fullmatch(raw) or int(raw) < 1:
        raise MalformedBackend(f"walk: k={raw!r} is not a positive integer or none{where}")
    return int(raw)


def _remote(params: dict[str, str], where: str) -> tuple[None, str, str | None]:
    _unknown_keys("remote-walk", params, ("endpoint", "wire"), where)
    endpoint = params.get("endpoint")
    if not endpoint:
        raise MalformedBackend(f"remote-walk needs endpoint=URL{where}")
    try:
        url = urlsplit(endpoint)
        port_ok = url.port is None or url.port > 0
    except ValueError:
        url, port_ok = None, False
    if url is None or url.scheme not in ("http", "https") or not url.hostname or not port_ok:
        raise MalformedBackend(
            f"remote-walk: endpoint={endpoint!r} is not an http(s)://host[:port] URL{where}"
        )
    wire = params.get("wire")
    if wire is not None:
        wire = wire.lower()
        if wire not in WIRES:
            raise MalformedBackend(
                f"remote-walk: wire={params['wire']!r}{where}; accepted: {', '.join(WIRES)}"
            )
    return None, endpoint.rstrip("/"), wire
