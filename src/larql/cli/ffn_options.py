"""The FFN options `run`, `walk` and `bench` share: `--ffn-policy SPEC` (any per-layer policy)
and `--ffn URL` (an FFN shard on every layer, shorthand for `remote-walk:endpoint=URL`); `run`'s
`--ffn-timeout-secs` and `--ffn-dispatch` tune that shard's client."""

from __future__ import annotations

from typing import Annotated

import typer

from larql.cli.common import InvalidInput

FfnPolicyOption = Annotated[
    str | None,
    typer.Option(
        "--ffn-policy",
        help="FFN per layer: dense | walk[:k=N] | null | remote-walk:endpoint=URL[,wire=f32|"
        "f16|i8], or bindings like '{walk:k=100}@layers=14-27;{dense}@otherwise'.",
    ),
]
FfnUrlOption = Annotated[
    str | None,
    typer.Option(
        "--ffn", help="URL of an FFN shard (larql serve --ffn-only) that runs every layer's FFN."
    ),
]


FfnTimeoutOption = Annotated[
    float | None,
    typer.Option(
        "--ffn-timeout-secs",
        help="With --ffn: seconds to wait for the shard's answer (default 60); past it the "
        "run ends with a typed error.",
    ),
]

FfnDispatchOption = Annotated[
    str | None,
    typer.Option(
        "--ffn-dispatch",
        help="With --ffn: streaming (default: a round trip per layer, exact) or batch (one round "
        "trip per step: every layer's FFN of the first layer's input — approximate, for "
        "high-latency links).",
    ),
]


MoeShardsOption = Annotated[
    str | None,
    typer.Option(
        "--moe-shards",
        help="A mixture-of-experts model's experts on shards (larql serve --ffn-only --experts "
        "A-B): 'A-B=URL,C-D=URL', covering every expert once; router, shared expert and dense "
        "layers stay here.",
    ),
]


def moe_shards_spec(shards: str, timeout: float | None = None) -> str:
    """`--moe-shards A-B=URL,C-D=URL` as the FFN policy it names."""
    from larql.inference.ffn.remote_experts import parse_moe_shards

    try:
        parsed = parse_moe_shards(shards)
    except ValueError as e:
        raise InvalidInput(f"--moe-shards: {e}; give A-B=URL,C-D=URL") from None
    joined = "|".join(f"{r.start}-{r.stop - 1}={url}" for r, url in parsed)
    return f"remote-experts:shards={joined}" + ("" if timeout is None else f",timeout={timeout}")


def ffn_policy_spec(
    policy: str | None,
    url: str | None,
    default: str = "dense",
    timeout: float | None = None,
    moe_shards: str | None = None,
    dispatch: str | None = None,
) -> str:
    """The policy spec the options ask for (`default` when none is given)."""
    if sum(x is not None for x in (policy, url, moe_shards)) > 1:
        raise InvalidInput("give one of --ffn URL, --ffn-policy SPEC and --moe-shards")
    if dispatch is not None:
        if url is None:
            raise InvalidInput(
                "--ffn-dispatch applies to --ffn URL (in a policy: remote-walk:...,dispatch=batch)"
            )
        if dispatch.lower() not in ("streaming", "batch"):
            raise InvalidInput(f"unknown --ffn-dispatch {dispatch!r}; accepted: streaming, batch")
    if moe_shards is not None:
        return moe_shards_spec(moe_shards, timeout)
    if timeout is not None and url is None:
        raise InvalidInput(
            "--ffn-timeout-secs applies to --ffn URL and --moe-shards (in a policy: "
            "remote-walk:...,timeout=S)"
        )
    if url is not None:
        if "://" not in url:
            raise InvalidInput(
                f"--ffn takes the URL of an FFN shard (http://host:port), got {url!r}; "
                "use --ffn-policy for local backends"
            )
        spec = f"remote-walk:endpoint={url}" + ("" if timeout is None else f",timeout={timeout}")
        return spec + ("" if dispatch is None else f",dispatch={dispatch.lower()}")
    return default if policy is None else policy


def check_policy(spec: str) -> None:
    """Parse early, before a model is loaded, so a typo fails fast."""
    from larql.inference.ffn.policy import FfnLayerPolicy

    FfnLayerPolicy.from_spec(spec)
