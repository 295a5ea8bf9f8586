"""The Python API as docs/API.md describes it, on the real default model loaded as the commands
load it: `generate` gives what `larql run` and the generation loop give, `stream` joins to it,
teacher-forced logits agree with greedy decoding, bad input is a typed error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import larql
from larql.cli.app import app
from larql.inference.errors import EmptyPrompt
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate as generation_loop
from larql.inference.prompt import ContextOverflow
from larql.kv.resolve import ENV_VAR
from larql.kv.spec import MalformedEngineSpec, NotAvailableForLiveDecode, UnknownEngine
from larql.models import Model

PROMPT = "Alice put the red ball in the box, and Bob"


@pytest.fixture
def model(smollm2_default: Model) -> Model:
    return smollm2_default


def cli_run(monkeypatch: pytest.MonkeyPatch, model: Model, *args: str) -> dict:
    """`larql run … --output json` on `model` (loaded as the command loads it)."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr("larql.cli.run_cmd.open_model", lambda *a, **k: model)
    result = CliRunner().invoke(app, ["run", *args, "--output", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_larql_is_light_and_names_the_api() -> None:
    code = "import sys, larql; print('torch' in sys.modules, 'generate' in dir(larql))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]
    with pytest.raises(AttributeError, match="no attribute 'genrate'"):
        _ = larql.genrate  # type: ignore[attr-defined]


@pytest.mark.parametrize("spec", ["standard", "turbo-quant:bits=4"])
def test_generate_gives_what_larql_run_gives(
    model: Model, monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    ours = larql.generate(model, larql.parse_engine(spec), PROMPT, max_new_tokens=8)
    theirs = cli_run(monkeypatch, model, PROMPT, "-n", "8", "--engine", spec)
    assert ours.token_ids == theirs["tokens"] and len(ours.token_ids) == 8
    assert ours.text == theirs["text"] and ours.memory == theirs["memory_bytes"]
    assert set(ours.as_json()) == set(theirs)
    # and what the generation loop gives the same engine, built by hand
    prompt_ids = model.tokenizer.encode(PROMPT)
    loop = generation_loop(
        larql.parse_engine(spec).build(model), model, DenseFfn(model), prompt_ids, 8
    )
    assert ours.token_ids == loop.tokens and ours.prompt_ids == prompt_ids


def test_stream_pieces_join_to_the_generated_text(model: Model) -> None:
    pieces = list(larql.stream(model, "markov-rs:window=4", PROMPT, max_new_tokens=10))
    whole = larql.generate(model, "markov-rs:window=4", PROMPT, max_new_tokens=10)
    assert len(pieces) > 1 and all(pieces)
    assert "".join(pieces) == whole.text
    seen: list[str] = []
    again = larql.generate(model, "standard", PROMPT, max_new_tokens=10, on_text=seen.append)
    assert "".join(seen) == again.text and again.token_ids == whole.token_ids  # exact engine


def test_teacher_forced_argmax_is_the_greedy_continuation(model: Model) -> None:
    spec = larql.parse_engine("turbo-quant:bits=3")
    greedy = larql.generate(model, spec, PROMPT, max_new_tokens=8)
    ids = greedy.prompt_ids + greedy.token_ids
    logits = larql.teacher_forced_logits(model, spec, ids, prompt_tokens=len(greedy.prompt_ids))
    assert logits.shape == (len(greedy.token_ids) + 1, model.config.vocab_size)
    assert logits[:-1].argmax(-1).tolist() == greedy.token_ids
    whole = larql.teacher_forced_logits(model, "standard", PROMPT)  # one row per prompt token
    assert whole.shape == (len(greedy.prompt_ids), model.config.vocab_size)
    assert (
        whole[-1].argmax().item()
        == larql.generate(model, "standard", PROMPT, max_new_tokens=1).token_ids[0]
    )


def test_memory_is_the_engine_state_and_turbo_quant_holds_less(model: Model) -> None:
    standard = larql.generate(model, "standard", PROMPT, max_new_tokens=6)
    quantised = larql.generate(model, "turbo-quant:bits=4", PROMPT, max_new_tokens=6)
    assert standard.memory == standard.memory_breakdown.state > 0
    assert 0 < quantised.memory < standard.memory
    cfg = model.config  # float32 K/V of the prompt and every fed-back token
    rows = len(standard.prompt_ids) + len(standard.token_ids) - 1
    assert standard.memory == cfg.num_layers * 2 * cfg.kv_dim * 4 * rows


def test_one_spec_serves_many_calls(model: Model) -> None:
    spec = larql.parse_engine("standard:window=4")
    first, second = (larql.generate(model, spec, PROMPT, max_new_tokens=6) for _ in range(2))
    assert first.token_ids == second.token_ids and first.memory == second.memory
    with pytest.raises(larql.InvalidInput, match="pass its spec"):
        larql.generate(model, spec.build(model), PROMPT)  # type: ignore[arg-type]


def test_prompts_as_ids_and_as_a_chat_turn(model: Model) -> None:
    ids = model.tokenizer.encode(PROMPT)
    as_text = larql.generate(model, "standard", PROMPT, max_new_tokens=4)
    assert larql.generate(model, "standard", ids, max_new_tokens=4).token_ids == as_text.token_ids
    chat = larql.generate(model, "standard", "Hi", chat=True, max_new_tokens=1)
    assert chat.prompt_ids == model.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])


def test_a_bad_spec_is_the_error_the_cli_gives(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(UnknownEngine, match="supported: standard") as caught:
        larql.parse_engine("foo")
    assert isinstance(caught.value, larql.EngineSpecError)
    with pytest.raises(MalformedEngineSpec, match="bits=9 must be one of 2, 3, 4"):
        larql.generate(model, "turbo-quant:bits=9", PROMPT)
    monkeypatch.delenv(ENV_VAR, raising=False)
    cli = CliRunner().invoke(app, ["run", PROMPT, "--engine", "foo"])
    assert cli.exit_code == 2 and str(caught.value) in cli.stderr


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda m: larql.generate(m, "standard", PROMPT, max_new_tokens=0),
            larql.InvalidInput,
            "max_new_tokens must be ≥ 1",
        ),
        (lambda m: larql.generate(m, "standard", "  "), larql.InvalidInput, "prompt is empty"),
        (lambda m: larql.generate(m, "standard", [10**7]), larql.InvalidInput, "vocabulary"),
        (lambda m: larql.generate(m, "apollo", PROMPT), NotAvailableForLiveDecode, "live decode"),
        (
            lambda m: larql.generate(m, "standard", PROMPT, temperature=-1),
            larql.LarqlError,
            "temperature must be ≥ 0",
        ),
        (lambda m: larql.generate(m, "standard", [1] * 9000), ContextOverflow, "context is"),
        (lambda m: larql.stream(m, 42, PROMPT), larql.InvalidInput, "spec string"),
        (
            lambda m: larql.teacher_forced_logits(m, "standard", [1, 2], prompt_tokens=3),
            larql.InvalidInput,
            "prompt_tokens must be in 1..2",
        ),
        (
            lambda m: larql.bench(m, "standard", prompt_tokens=8, prompt="x"),
            larql.InvalidInput,
            "give one of prompt_tokens, depths, prompt",
        ),
        (lambda m: larql.bench(m, ";"), larql.InvalidInput, "engine list is empty"),
        (lambda m: larql.accuracy(m, "standard", ffn_policy="walk:k=0"), larql.LarqlError, "k"),
        (lambda m: larql.load_model("no-such-model"), larql.LarqlError, "unknown model"),
        (lambda m: larql.load_model(threads=0), larql.InvalidInput, "threads must be ≥ 1"),
    ],
)
def test_bad_input_is_a_typed_error(model: Model, call, error, message: str) -> None:
    with pytest.raises(error, match=message):
        call(model)


def test_empty_ids_are_refused_before_the_engine(model: Model) -> None:
    with pytest.raises(larql.InvalidInput, match="no tokens"):
        larql.teacher_forced_logits(model, "standard", [])
    assert not issubclass(EmptyPrompt, larql.InvalidInput)  # the engine's own check is another


@pytest.mark.slow
def test_bench_and_accuracy_return_the_cli_reports(model: Model) -> None:
    bench = larql.bench(
        model,
        ["standard", larql.parse_engine("no-cache")],
        depths=[0, 8],
        max_new_tokens=2,
        warmup=0,
        repeats=1,
    )
    data = bench.as_dict()
    assert data["schema"] == "larql.bench/1"
    assert [(r["spec"], r["depth"]) for r in data["rows"]] == [
        ("standard", 0),
        ("no-cache", 0),
        ("standard", 8),
        ("no-cache", 8),
    ]
    lossy = "turbo-quant:bits=2,recent=0"
    report = larql.accuracy(
        model, f"standard;{lossy}", quick=True, positions=8, needle_max_tokens=0, conflict=False
    )
    data = report.as_dict()
    assert data["schema"] == "larql.accuracy/1" and data["kv_engines"] == ["standard", lossy]
    by_spec = {f.spec: f for f in report.fidelity}
    assert by_spec["standard"].mean_kl == 0.0 < by_spec[lossy].mean_kl
    assert torch.isfinite(torch.tensor(by_spec[lossy].mean_kl))


# (call with the renamed argument, old name, new name, a value both refuse, the refusal)
RENAMED = [
    (lambda m, **kw: larql.bench(m, "standard", **kw), "context", "prompt_tokens", 0, "≥ 1"),
    (lambda m, **kw: larql.bench(m, "standard", **kw), "tokens", "max_new_tokens", 0, "≥ 1"),
    (lambda m, **kw: larql.bench(m, "standard", **kw), "ffn", "ffn_policy", "walk:k=0", "k"),
    (lambda m, **kw: larql.accuracy(m, "standard", **kw), "ffn", "ffn_policy", "walk:k=0", "k"),
    (lambda m, **kw: larql.generate(m, "standard", PROMPT, **kw), "ffn", "ffn_policy", "x", "x"),
    (lambda m, **kw: larql.stream(m, "standard", PROMPT, **kw), "ffn", "ffn_policy", "x", "x"),
    (lambda m, **kw: larql.prefill(m, "standard", PROMPT, **kw), "ffn", "ffn_policy", "x", "x"),
    (
        lambda m, **kw: larql.teacher_forced_logits(m, "standard", PROMPT, **kw),
        "ffn",
        "ffn_policy",
        "x",
        "x",
    ),
]


@pytest.mark.parametrize(
    "call, old, new, value, refusal", RENAMED, ids=lambda x: x if isinstance(x, str) else None
)
def test_an_old_argument_name_warns_and_means_the_same(
    model: Model, call, old: str, new: str, value: object, refusal: str
) -> None:
    """The API speaks the CLI's vocabulary (`prompt_tokens`, `max_new_tokens`, `ffn_policy`);
    an old name still reaches the same argument, with a DeprecationWarning naming the new."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new name: no warning
        with pytest.raises(larql.LarqlError, match=refusal) as current:
            call(model, **{new: value})
    warned = rf"\({old}=…\) is deprecated; use {new}="
    with (
        pytest.warns(DeprecationWarning, match=warned),
        pytest.raises(type(current.value)) as previous,
    ):
        call(model, **{old: value})
    assert str(previous.value) == str(current.value)  # the same argument got the value
    with pytest.raises(larql.InvalidInput, match=rf"give {new}= only \({old}= is its old name\)"):
        call(model, **{old: value, new: value})


def test_the_signatures_show_only_the_new_names() -> None:
    import inspect

    for function, names in [
        (larql.bench, {"prompt_tokens", "max_new_tokens", "ffn_policy"}),
        (larql.accuracy, {"prompt_tokens", "ffn_policy"}),
        (larql.generate, {"max_new_tokens", "ffn_policy"}),
        (larql.stream, {"max_new_tokens", "ffn_policy"}),
        (larql.prefill, {"ffn_policy"}),
        (larql.teacher_forced_logits, {"prompt_tokens", "ffn_policy"}),
        (larql.resume, {"ffn_policy"}),
    ]:
        parameters = set(inspect.signature(function).parameters)
        assert names <= parameters, function.__name__
        assert not {"context", "ffn"} & parameters, function.__name__
        # (teacher_forced_logits' `tokens` is the sequence it is given, not a count)
        assert "tokens" not in parameters or function is larql.teacher_forced_logits


def test_an_old_name_gives_the_same_generation(model: Model) -> None:
    current = larql.generate(model, "standard", PROMPT, max_new_tokens=3, ffn_policy="dense")
    with pytest.warns(DeprecationWarning, match="use ffn_policy="):
        previous = larql.generate(model, "standard", PROMPT, max_new_tokens=3, ffn="dense")
    assert previous.token_ids == current.token_ids and previous.ffn == current.ffn
