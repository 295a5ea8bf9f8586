"""`larql walk`: look inside the FFN — which features fire at the last position, and what each
one writes — or generate / compare with the walk FFN (top-k features per layer)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from larql.cli.common import InvalidInput, open_model, read_prompt, stderr, stdout, user_errors
from larql.cli.ffn_options import FfnPolicyOption, FfnUrlOption, check_policy, ffn_policy_spec
from larql.cli.options import (
    DeviceOption,
    DtypeOption,
    ModelOption,
    ThreadsOption,
    WeightsOption,
    parse_layer_range,
)
from larql.cli.renamed import output_format, renamed

OUTPUTS = ("text", "json")


def walk_layers(value: str | None, num_layers: int) -> range:
    """`--layers A-B` (inclusive) or `A` → a range of layers the model has (default: all)."""
    if value is None:
        return range(num_layers)
    first, last = parse_layer_range(value)
    if last >= num_layers:
        raise InvalidInput(f"--layers {value} is outside the model's layers 0-{num_layers - 1}")
    return range(first, last + 1)


def walk_policy(k: int | None, policy: str | None, url: str | None = None) -> str:
    if k is not None and (policy is not None or url is not None):
        raise InvalidInput("give -k N (walk:k=N on every layer), --ffn-policy or --ffn, not both")
    if policy is not None or url is not None:
        return ffn_policy_spec(policy, url)
    if k is not None and k < 1:
        raise InvalidInput(f"-k/--features must be ≥ 1, got {k}")
    return "walk" if k is None else f"walk:k={k}"


@user_errors
def walk(
    prompt: Annotated[str, typer.Argument(help="Prompt text, or - to read it from stdin.")],
    model: ModelOption = None,
    k: Annotated[
        int | None,
        typer.Option("-k", "--features", help="Features kept per layer (walk:k=N); default all."),
    ] = None,
    old_k: Annotated[
        int | None, typer.Option("--top-k", hidden=True, help="Old spelling of -k/--features.")
    ] = None,
    layers: Annotated[
        str | None, typer.Option("--layers", help="Layers to show, A-B inclusive (default all).")
    ] = None,
    top: Annotated[int, typer.Option("--top", help="Features shown per layer.")] = 5,
    predict: Annotated[
        bool, typer.Option("--predict", help="Generate -n tokens with the walk FFN instead.")
    ] = False,
    max_tokens: Annotated[int, typer.Option("-n", "--max-tokens", help="With --predict.")] = 16,
    engine: Annotated[
        str | None, typer.Option("--engine", help="KV engine spec for --predict.")
    ] = None,
    kv_cache: Annotated[
        str,
        typer.Option(
            "--kv-cache", help="Legacy engine flag for --predict: standard|markov-bounded|none."
        ),
    ] = "standard",
    context_window: Annotated[
        int,
        typer.Option("--context-window", help="Legacy window for --kv-cache markov-bounded."),
    ] = 0,
    ffn_policy: FfnPolicyOption = None,
    ffn: FfnUrlOption = None,
    compare: Annotated[
        bool, typer.Option("--compare", help="Dense vs walk next-token top-5 and their KL.")
    ] = False,
    output: Annotated[str, typer.Option("--output", "-o", help="text or json.")] = "text",
    dtype: DtypeOption = "float32",
    weights: WeightsOption = "auto",
    device: DeviceOption = "cpu",
    threads: ThreadsOption = None,
    verbose: Annotated[
        bool,
        typer.Option(
            "-v",
            "--verbose",
            help="Prompt tokens and the FFN on stderr; with --predict also the engine, the "
            "decode path, prefill ms and decode tok/s.",
        ),
    ] = False,
) -> None:
    """Which FFN features fire at the last position of PROMPT, and what each one writes.

    Per layer: feature id, activation (act(gate·x)·(up·x), the coefficient of its down vector;
    with -k only the k features the walk keeps) and the tokens its down vector writes most
    strongly through the unembedding (top of lm_head · down column; a negative activation
    pushes those tokens down)."""
    k = renamed(k, old_k, "-k/--features", "--top-k", None)
    output = output_format(output, OUTPUTS)
    if predict and compare:
        raise InvalidInput("give --predict or --compare, not both")
    if top < 1 or max_tokens < 1:
        raise InvalidInput("--top and -n/--max-tokens must be ≥ 1")
    from larql.cli.walk_modes import compare_walk, feature_rows, predict_tokens
    from larql.inference.ffn import build_ffn
    from larql.inference.prompt import check_context
    from larql.kv.resolve import resolve_engine

    if ffn is not None and not (predict or compare):
        raise InvalidInput(
            "--ffn URL runs the FFN on a shard: give --predict or --compare with it (the feature "
            "table reads the local FFN's gates)"
        )
    spec = walk_policy(k, ffn_policy, ffn)
    check_policy(spec)
    choice = resolve_engine(engine, kv_cache, context_window) if predict else None
    if choice is not None:
        choice.engine.require_live_decode()
        for warning in choice.warnings:
            stderr.print(f"warning: {warning}")
    text = read_prompt(prompt)
    lm = open_model(model, dtype, device, threads, weights)
    ids = lm.tokenizer.encode(text)
    check_context(lm, len(ids))
    shown = walk_layers(layers, lm.config.num_layers)
    router = build_ffn(lm, spec)
    try:
        if predict:
            assert choice is not None
            data = predict_tokens(
                lm,
                router,
                choice.engine.build(lm),
                choice.engine.spec(),
                ids,
                max_tokens,
                output == "text",
            )
        elif compare:
            data = compare_walk(lm, router, ids)
        else:
            data = feature_rows(lm, router, ids, shown, top)
    finally:
        router.close()
    data = {"model": lm.name, "prompt_tokens": len(ids), "ffn": router.name, **data}
    if output == "json":
        print(json.dumps(data, indent=2))
    elif compare:
        _print_compare(data)
    elif not predict:
        _print_features(data)
    if verbose:
        _print_verbose(data)


# ---------------------------------------------------------------------------- rendering


def _print_features(data: dict[str, Any]) -> None:
    predicted = data["prediction"][0]
    table = Table(
        title=f"{data['model']}: features firing at position {data['position']} "
        f"(ffn {data['ffn']}; next token {predicted['text']!r})",
        caption="activation = act(gate·x)·(up·x); writes = top of lm_head · down column",
    )
    for column, justify in (
        ("layer", "right"),
        ("feature", "right"),
        ("activation", "right"),
        ("gate", "right"),
        ("writes", "left"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in data["layers"]:
        if not row["features"]:
            table.add_row(str(row["layer"]), "—", "—", "—", f"({row['backend']}: no FFN)")
        for i, f in enumerate(row["features"]):
            table.add_row(
                str(row["layer"]) if i == 0 else "",
                str(f["feature"]),
                f"{f['activation']:+.3f}",
                f"{f['gate']:+.3f}",
                "  ".join(repr(t["text"]) for t in f["writes"]),
                end_section=i == len(row["features"]) - 1,
            )
    stdout.print(table)


def _print_verbose(data: dict[str, Any]) -> None:
    """`-v`: what ran, on stderr, as `larql run -v` says it."""
    stderr.print(f"model: {data['model']}   prompt tokens: {data['prompt_tokens']}", markup=False)
    stderr.print(f"ffn: {data['ffn']}", markup=False)
    if "decode_path" not in data:
        return
    rate = data["decode_tok_s"]
    stderr.print(f"engine: {data['engine']}", markup=False)
    stderr.print(f"decode path: {data['decode_path']}", markup=False)
    stderr.print(
        f"prefill: {data['prefill_ms']:.1f} ms   decode: "
        + (f"{rate:.1f} tok/s" if rate else "n/a (one token)")
    )
    stderr.print(f"finish: {data['finish_reason']}")


def _print_compare(data: dict[str, Any]) -> None:
    table = Table(title=f"{data['model']}: next token, dense vs {data['ffn']}")
    for column in ("rank", "dense", "p", data["ffn"], "p"):
        table.add_column(column)
    for i, (d, w) in enumerate(zip(data["dense"], data["walk"], strict=True), start=1):
        table.add_row(
            str(i),
            repr(d["text"]),
            f"{d['probability']:.4f}",
            repr(w["text"]),
            f"{w['probability']:.4f}",
        )
    stdout.print(table)
    stdout.print(
        f"KL(dense ‖ {data['ffn']}) = {data['kl_dense_walk']:.6f} nats   "
        f"same top-1: {'yes' if data['same_top1'] else 'no'}"
    )
