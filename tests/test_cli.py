"""`larql run`, `larql engines`, `larql models` as a user calls them: precedence, warnings, typed
errors with exit code 2 and no traceback, JSON schema, stdin, chat template."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from larql import __version__ as larql_version
from larql.cli.app import app
from larql.kv import supported_names
from larql.kv.resolve import ENV_VAR
from larql.models import Model

RUN_KEYS = {
    "model",
    "engine",
    "prompt_tokens",
    "token_ids",
    "tokens",
    "text",
    "finish_reason",
    "prefill_ms",
    "decode_tok_s",
    "memory_bytes",
    "memory",
}


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    runner = CliRunner()

    def invoke(*args: str, input: str | None = None, env: dict[str, str] | None = None):
        return runner.invoke(app, list(args), input=input, env=env)

    return invoke


def run_json(cli, *args: str, **kwargs) -> dict:
    result = cli("run", *args, "--output", "json", **kwargs)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_json_output_schema(cli, smollm2: Model) -> None:
    out = run_json(cli, "The capital of France is", "-n", "6")
    assert set(out) == RUN_KEYS
    assert out["model"] == "smollm2-135m"
    assert out["engine"] == "standard"
    assert out["prompt_tokens"] == len(smollm2.tokenizer.encode("The capital of France is"))
    assert len(out["token_ids"]) == 6 and out["tokens"] == out["token_ids"]
    assert out["finish_reason"] == "length"
    assert out["text"].startswith(" Paris")
    assert out["prefill_ms"] > 0 and out["decode_tok_s"] > 0
    cfg = smollm2.config
    rows = out["prompt_tokens"] + 5  # the last token picked is never fed back
    memory = out["memory"]
    assert out["memory_bytes"] == memory["state_bytes"] == memory["hot_bytes"]
    assert memory["state_bytes"] == cfg.num_layers * 2 * cfg.kv_dim * 4 * rows  # float32 K/V
    assert memory["held_bytes"] == memory["state_bytes"] + memory["reserve_bytes"]
    assert memory["reserve_bytes"] > 0 and memory["cold_bytes"] == memory["derivative_bytes"] == 0


def test_verbose_reports_state_and_reserve_apart(cli) -> None:
    result = cli("run", "The capital of France is", "-n", "4", "-v")
    assert result.exit_code == 0, result.output
    line = next(x for x in result.stderr.splitlines() if x.startswith("engine memory:"))
    assert "state " in line and "+ reserve " in line and " B held" in line
    summary = next(x for x in result.stderr.splitlines() if x.startswith("engine:"))
    assert "MiB" in summary and "MB" not in summary.replace("MiB", "")


def test_text_output_streams_the_same_text(cli) -> None:
    as_json = run_json(cli, "The capital of France is", "-n", "8")
    as_text = cli("run", "The capital of France is", "-n", "8")
    assert as_text.exit_code == 0
    assert as_text.stdout == as_json["text"] + "\n"


def test_engine_option_and_window(cli) -> None:
    out = run_json(cli, "The capital of France is", "-n", "4", "--engine", "standard:window=8")
    assert out["engine"] == "standard:window=8"


# long: test_spec's resolve tests hold the env var's place in the precedence, and test_server's
# test_serve_default_engine_precedence reads it through the CLI
@pytest.mark.long
def test_env_var_selects_the_engine(cli) -> None:
    out = run_json(cli, "Hello", "-n", "3", env={ENV_VAR: "no-cache"})
    assert out["engine"] == "no-cache"
    out = run_json(cli, "Hello", "-n", "3", "--engine", "standard", env={ENV_VAR: "no-cache"})
    assert out["engine"] == "standard"


# long: test_spec's resolve tests map --kv-cache none / markov-bounded and warn where --engine
# wins, and test_cli_small_gaps runs --kv-cache through `larql run` with its warning
@pytest.mark.long
def test_kv_cache_legacy_flag_and_warning(cli) -> None:
    assert run_json(cli, "Hello", "-n", "2", "--kv-cache", "none")["engine"] == "no-cache"
    bounded = run_json(
        cli, "Hello", "-n", "2", "--kv-cache", "markov-bounded", "--context-window", "16"
    )
    assert bounded["engine"] == "standard:window=16"
    result = cli("run", "Hello", "-n", "2", "--engine", "standard", "--kv-cache", "none")
    assert result.exit_code == 0
    assert "warning: --kv-cache none is ignored" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "foo"], "unknown engine 'foo'"),
        (["--engine", "standard:window=abc"], "is not an integer"),
        (["--kv-cache", "nonsense"], "unknown --kv-cache"),
        (["-m", "no-such-model"], "unknown model 'no-such-model'"),
        (["-n", "0"], "must be ≥ 1"),
        (["--output", "xml"], "unknown --output"),
        (["--temperature", "-1"], "temperature must be ≥ 0"),
        (["--dtype", "int3"], "unknown dtype"),
        (["--device", "tpu"], "device"),
        (["--top", "-1"], "--top must be ≥ 0"),
    ],
)
def test_bad_input_exits_2_with_a_message(cli, args: list[str], message: str) -> None:
    result = cli("run", "Hello", *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_unknown_engine_lists_the_catalog(cli) -> None:
    result = cli("run", "Hello", "--engine", "nope")
    assert result.exit_code == 2
    assert "supported: " + ", ".join(supported_names()) in result.stderr


def test_empty_prompt(cli) -> None:
    for prompt, stdin in (("", None), ("-", "   \n")):
        result = cli("run", prompt, input=stdin)
        assert result.exit_code == 2
        assert "prompt is empty" in result.stderr


def test_prompt_from_stdin(cli) -> None:
    out = run_json(cli, "-", "-n", "3", input="The capital of France is")
    assert out["prompt_tokens"] == 5
    piped = run_json(cli, "-", "-n", "3", input="The capital of France is\n")  # as echo sends it
    timings = {"prefill_ms": piped["prefill_ms"], "decode_tok_s": piped["decode_tok_s"]}
    assert piped == {**out, **timings}


def test_prompt_beyond_the_context_is_refused(cli) -> None:
    result = cli("run", "-", "-n", "2", input="hello " * 9000)
    assert result.exit_code == 2
    assert "context is 8192 tokens" in result.stderr


def test_chat_uses_the_model_template(cli, smollm2: Model) -> None:
    question = "What is the capital of France?"
    out = run_json(cli, "--chat", question, "-n", "16")
    rendered = smollm2.tokenizer.render_chat([{"role": "user", "content": question}])
    assert rendered.startswith("<|im_start|>system\n")
    assert rendered.endswith(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    assert out["prompt_tokens"] == len(smollm2.tokenizer.encode(rendered))
    assert "Paris" in out["text"]
    assert out["finish_reason"] == "stop"  # the model closes its turn with <|im_end|>
    assert "<|im_end|>" not in out["text"]


def test_engines_lists_the_catalog(cli) -> None:
    result = cli("engines", "--output", "json")
    assert result.exit_code == 0
    rows = json.loads(result.stdout)
    assert [r["name"] for r in rows] == supported_names()
    assert all(r["contract"] and r["keeps"] for r in rows)
    table = cli("engines")
    assert table.exit_code == 0 and "standard" in table.stdout


def test_models_lists_the_registry(cli) -> None:
    result = cli("models", "--output", "json")
    assert result.exit_code == 0
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert rows["smollm2-135m"]["installed"] and rows["smollm2-135m"]["default"]
    assert Path(rows["smollm2-135m"]["path"]).exists()
    assert "gemma3-270m" in rows


# long: test_help_and_version_answer_without_loading_torch and test_readme_examples' piped lines
# run the console script, test_server_shutdown `larql serve` through it, and
# test_json_output_schema checks `larql run`'s generation
@pytest.mark.long
@pytest.mark.slow
def test_console_script_runs(tmp_path: Path) -> None:
    larql = Path(sys.executable).with_name("larql")
    env = {**os.environ, "LARQL_KV_ENGINE": ""}
    proc = subprocess.run(
        [str(larql), "run", "The capital of France is", "-n", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


ACCEPTANCE_SPECS = [
    "markov-rs",
    "markov-rs:window=4",
    "markov-rs-codec",
    "boundary-kv:chunk_tokens=4",
    "boundary-per-layer",
    "windowed-checkpoint:window=128",
]


# long: test_engine_compliance's test_exact_engine_greedy_tokens_match_standard checks the same
# tokens for these engines, and test_engine_option_and_window and test_json_output_schema the
# CLI path that passes --engine through
@pytest.mark.long
def test_exact_engines_give_standard_tokens_through_the_cli(cli) -> None:
    """The exact engines' contract: the same 24 tokens from `larql run` for every exact engine."""
    prompt = "Alice put the red ball in the box, and Bob"
    reference = run_json(cli, prompt, "-n", "24")["tokens"]
    for spec in ACCEPTANCE_SPECS:
        assert run_json(cli, prompt, "-n", "24", "--engine", spec)["tokens"] == reference, spec


# long: test_turbo_quant's test_memory_is_the_bytes_stored checks turbo-quant's bytes exactly,
# and test_json_output_schema that `larql run` reports the engine's memory
@pytest.mark.long
def test_turbo_quant_reports_its_compressed_memory(cli) -> None:
    """Every row quantised (no exact rows): under a quarter of the float32 cache; with the
    default exact newest rows, a 13-token run is held exactly at 16 bits: half of float32."""
    standard = run_json(cli, "Alice put the red ball", "-n", "8")["memory_bytes"]
    for bits in (2, 3, 4):
        spec = f"turbo-quant:bits={bits},recent=0,sinks=0"
        out = run_json(cli, "Alice put the red ball", "-n", "8", "--engine", spec)
        assert 0 < out["memory_bytes"] < standard / 4
    default = run_json(cli, "Alice put the red ball", "-n", "8", "--engine", "turbo-quant")
    assert default["memory_bytes"] <= standard / 2 + 30 * 2 * 3 * 64 * 4  # + the mean rows


def test_apollo_is_refused_for_live_decode(cli) -> None:
    result = cli("run", "Hello", "--engine", "apollo")
    assert result.exit_code == 2
    assert "not available for live decode" in result.stderr


def test_help_and_version_answer_without_loading_torch() -> None:
    """`larql --help`, `-h` and `--version` import no torch (they answer in a fraction of a
    second); the commands import it in their bodies."""
    script = (
        "import sys; from larql.cli.app import app; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'larql.models.model' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
    larql = Path(sys.executable).with_name("larql")
    for args in (["--help"], ["-h"], ["run", "-h"], ["boundary", "ls", "-h"]):
        shown = subprocess.run([str(larql), *args], capture_output=True, text=True)
        assert shown.returncode == 0 and "Usage: larql" in shown.stdout, args
    version = subprocess.run([str(larql), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.strip() == f"larql {larql_version}"


def test_top_prints_the_next_token_table(cli, smollm2_default: Model) -> None:
    """--top N: the model's N most likely first tokens, the greedy pick first, probabilities
    the softmax of the prefill's logits."""
    import torch

    from larql.inference.ffn import DenseFfn
    from larql.inference.generation import next_token_logits
    from larql.kv import parse_engine

    out = run_json(cli, "The capital of France is", "-n", "1", "--top", "4")
    top = out["top"]
    assert len(top) == 4 and top[0]["id"] == out["tokens"][0] and top[0]["text"] == " Paris"
    model = smollm2_default
    ids = model.tokenizer.encode("The capital of France is")
    engine = parse_engine("standard").build(model)
    with torch.inference_mode():
        logits = next_token_logits(model, engine.prefill(model, DenseFfn(model), ids))
    probabilities = torch.softmax(logits, dim=-1)
    want = torch.topk(logits, 4).indices.tolist()
    assert [row["id"] for row in top] == want
    for row in top:
        assert row["probability"] == pytest.approx(float(probabilities[row["id"]]), rel=1e-5)
    assert "top" not in run_json(cli, "The capital of France is", "-n", "1")
    table = cli("run", "The capital of France is", "-n", "1", "--top", "2")
    assert table.exit_code == 0 and "next token after the prompt" in table.stdout
    assert "' Paris'" in table.stdout


@pytest.mark.parametrize(
    ("command", "option", "path", "message"),
    [
        (["bench", "-n", "1"], "--output-file", "missing/x.json", "no directory"),
        (["bench", "-n", "1"], "--output-file", ".", "is a directory"),
        (["bench", "-n", "1"], "--plot", "x.foo", "no plot format 'foo'; accepted: "),
        (["accuracy", "--quick"], "--plot", "missing/x.png", "no directory"),
        (["accuracy", "--suite", "longctx", "--quick"], "--output-file", "missing/x", "no dir"),
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_the_run(
    cli, tmp_path: Path, command: list[str], option: str, path: str, message: str
) -> None:
    """The check comes before the model loads: a long run does not end in a traceback at a
    path it cannot write."""
    result = cli(*command, option, str(tmp_path / path), "-m", "no-such-model")
    assert result.exit_code == 2, result.output
    assert f"{option} {tmp_path / path}" in result.stderr and message in result.stderr
    assert "Traceback" not in result.output


def test_plot_without_fidelity_is_refused_before_the_run(cli, tmp_path: Path) -> None:
    plot = str(tmp_path / "x.png")
    result = cli("accuracy", "--no-fidelity", "--plot", plot, "-m", "no-such-model")
    assert result.exit_code == 2
    assert "leave out --no-fidelity" in result.stderr


def test_a_state_directory_that_cannot_be_written_is_refused(cli, tmp_path: Path) -> None:
    file = tmp_path / "a-file"
    file.write_text("")
    result = cli("run", "Hello", "-n", "1", "--save-state", str(file))
    assert result.exit_code == 2
    assert f"--save-state {file} is a file" in result.stderr
    # under a file: the check passes no writable directory, and nothing is generated
    result = cli("run", "Hello", "-n", "1", "--save-state", str(file / "state"))
    assert result.exit_code == 2
    assert "is not a writable directory" in result.stderr


def test_layer_ranges_are_checked_alike(cli) -> None:
    for args, message in (
        (["walk", "Hello", "--layers", "3-1"], "--layers must be A-B with 0 ≤ A ≤ B, got '3-1'"),
        (["walk", "Hello", "--layers", "0-99"], "outside the model's layers 0-29"),
        (["walk", "Hello", "--layers", "x"], "--layers must be A-B (e.g. 0-15), got 'x'"),
    ):
        result = cli(*args)
        assert result.exit_code == 2, result.output
        assert message in result.stderr
