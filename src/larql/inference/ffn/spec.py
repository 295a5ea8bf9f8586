"""One FFN backend spec — `dense`, `walk[:k=N|none]`, `null`,
`remote-walk:endpoint=URL[,wire=f32|f16|i8]`, `remote-experts:shards=A-B=URL|C-D=URL` — in the
grammar engine specs use (`larql.specs`): strict, names and keys case-insensitive. A name we
do not know is `UnknownBackend`; a known name with bad parameters is `MalformedBackend`. Both
name the accepted forms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from larql.errors import LarqlError
from larql.specs import Param, at_least, one_of, parse_params, split_name

BackendName = Literal["dense", "walk", "remote-walk", "remote-experts", "null"]
ALIASES: dict[str, BackendName] = {
    "dense": "dense",
    "weight": "dense",
    "weights": "dense",
    "walk": "walk",
    "remote-walk": "remote-walk",
    "remote_walk": "remote-walk",
    "remote-experts": "remote-experts",
    "remote_experts": "remote-experts",
    "null": "null",
    "off": "null",
}
SUPPORTED = ("dense", "walk", "remote-walk", "remote-experts", "null")
WIRES = ("f32", "f16", "i8")
ACCEPTED = (
    "supported: dense (alias weight, weights), walk[:k=N|none], null (alias off), "
    "remote-walk:endpoint=URL[,wire=f32|f16|i8][,timeout=SECONDS][,dispatch=streaming|batch] "
    "(alias remote_walk), "
    "remote-experts:shards=A-B=URL|C-D=URL[,wire=…][,timeout=SECONDS] (a mixture of experts' "
    "experts on shards)"
)


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


def _http_url(endpoint: str) -> str | None:
    try:
        url = urlsplit(endpoint)
        port_ok = url.port is None or url.port > 0
    except ValueError:
        return "is not an http(s)://host[:port] URL"
    if url.scheme not in ("http", "https") or not url.hostname or not port_ok:
        return "is not an http(s)://host[:port] URL"
    return None


DISPATCHES = ("streaming", "batch")
REMOTE_PARAMS = (
    Param("wire", str, None, "f32 (lossless), f16 or i8", one_of(*WIRES), lower=True),
    Param(
        "timeout",
        float,
        None,
        "seconds to wait for the shard's answer (default 60); past it a typed error",
        lambda v: None if math.isfinite(v) and v > 0 else "must be a number of seconds > 0",
    ),
)


def _moe_shards(text: str) -> str | None:
    from larql.inference.ffn.remote_experts import parse_moe_shards

    try:
        shards = parse_moe_shards(text)
    except ValueError as e:
        return str(e)
    for _, url in shards:
        problem = _http_url(url)
        if problem is not None:
            return f"{url!r} {problem}"
    return None


PARAMS: dict[BackendName, tuple[Param, ...]] = {
    "dense": (),
    "null": (),
    "walk": (
        Param(
            "k",
            int,
            None,
            "features kept per position (none: all, the dense result)",
            at_least(1),
            none_word="none",
        ),
    ),
    "remote-walk": (
        Param("endpoint", str, None, "the FFN shard's http(s)://host[:port]", _http_url),
        *REMOTE_PARAMS,
        Param(
            "dispatch",
            str,
            None,
            "streaming (default: a round trip per layer, exact) or batch (one round trip per "
            "step: every layer's FFN of the first layer's input — approximate)",
            one_of(*DISPATCHES),
            lower=True,
        ),
    ),
    "remote-experts": (
        Param("shards", str, None, "A-B=URL|C-D=URL: the expert shards", _moe_shards),
        *REMOTE_PARAMS,
    ),
}


@dataclass(frozen=True)
class FfnSpec:
    """A parsed FFN backend spec."""

    name: BackendName
    k: int | None = None  # walk: features kept per position (None = all, dense-equivalent)
    endpoint: str | None = None  # remote-walk
    shards: str | None = None  # remote-experts: A-B=URL|C-D=URL
    wire: str | None = None  # remote-walk: f32 | f16 | i8 (None = f32)
    timeout: float | None = None  # remote-walk: read timeout in seconds (None = the default)
    dispatch: str | None = None  # remote-walk: streaming | batch (None = streaming)

    @classmethod
    def parse(cls, spec: str, context: str | None = None) -> FfnSpec:
        """`context` is the binding the spec came from, quoted in error messages."""
        where = f" in `{context}`" if context else ""
        written, raw, colon = split_name(spec)
        name = ALIASES.get(written.lower())
        if name is None:
            shown = repr(written) if written else "an empty name"
            raise UnknownBackend(f"unknown FFN backend {shown}{where}; {ACCEPTED}", written.lower())
        values = parse_params(name, PARAMS[name], raw, colon, MalformedBackend, where)
        if name == "remote-walk":
            if values["endpoint"] is None:
                raise MalformedBackend(f"remote-walk needs endpoint=URL{where}")
            values["endpoint"] = values["endpoint"].rstrip("/")
        if values.get("dispatch") == "streaming":
            values["dispatch"] = None  # the default, one canonical spelling
        if name == "remote-experts" and values["shards"] is None:
            raise MalformedBackend(f"remote-experts needs shards=A-B=URL|C-D=URL{where}")
        return cls(name, **values)

    def spec(self) -> str:
        """Canonical spec; parsing it gives back an equal one."""
        if self.name == "walk":
            return "walk" if self.k is None else f"walk:k={self.k}"
        if self.name == "remote-walk":
            wire = f",wire={self.wire}" if self.wire else ""
            timeout = f",timeout={self.timeout:g}" if self.timeout is not None else ""
            batch = ",dispatch=batch" if self.dispatch == "batch" else ""
            return f"remote-walk:endpoint={self.endpoint}{wire}{timeout}{batch}"
        if self.name == "remote-experts":
            wire = f",wire={self.wire}" if self.wire else ""
            timeout = f",timeout={self.timeout:g}" if self.timeout is not None else ""
            return f"remote-experts:shards={self.shards}{wire}{timeout}"
        return self.name
