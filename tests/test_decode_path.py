"""`larql run -v` and bench's JSON name the decode path that ran: device · dtype · how the
weights were read · the kernel path, noted where each path is taken (`larql.kernels.ran`)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import larql.inference.ffn.backend as ffn_backend_module
import larql.inference.fused_layer as fused_layer_module
import larql.inference.layer as layer_module
import larql.inference.linear as linear_module
from larql.cli.app import app
from larql.harness.bench.engine_bench import BenchSettings, bench_engine
from larql.inference.decode_path import decode_path
from larql.inference.ffn import DenseFfn
from larql.inference.generation import GenerationSession
from larql.kernels.cpu import cpu_extension
from larql.kernels.ran import BLOCK_PRODUCTS, FUSED_LAYERS, ran, recording, step_kinds
from larql.kv import parse_engine
from larql.kv.resolve import ENV_VAR
from larql.models import Model

BUILT = cpu_extension() is not None


def test_a_recording_sees_what_its_block_ran_and_nothing_else() -> None:
    ran(FUSED_LAYERS)  # outside any recording: noted nowhere
    outer: set[str] = set()
    with recording(outer):
        inner: set[str] = set()
        with recording(inner):
            ran(BLOCK_PRODUCTS)
        ran(FUSED_LAYERS)
    assert inner == {BLOCK_PRODUCTS}
    assert outer == {BLOCK_PRODUCTS, FUSED_LAYERS}
    assert step_kinds(outer) == "fused C++ layers + C++ block products"
    assert step_kinds(set()) == "eager torch"


def test_run_verbose_names_the_decode_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real default model, as `larql run` loads it: on the CPU its decode steps go through
    the extension's whole-step call where the extension is built, reading the GGUF blocks."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    result = CliRunner().invoke(app, ["run", "Hi", "-n", "3", "-v"])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.stderr.splitlines() if x.startswith("decode path: "))
    assert line.startswith("decode path: cpu · float32 · ")
    if BUILT:
        assert line.endswith("weights in GGUF blocks · fused C++ layers"), line
    else:
        assert line.endswith("weights dequantised · eager torch"), line


def _session_path(model: Model, spec: str, steps: int = 3) -> str:
    engine = parse_engine(spec).build(model)
    ids = model.tokenizer.encode("The capital of France is")
    session = GenerationSession(engine, model, DenseFfn(model), ids, steps, stop_ids=frozenset())
    session.prefill()
    while not session.finished:
        session.step()
    done = session.result()
    return decode_path(model, done.decode_kinds, len(done.step_ms))


@pytest.mark.slow
@pytest.mark.skipif(not BUILT, reason="the CPU extension is not built")
def test_the_path_is_what_ran_not_what_could(
    smollm2_default: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the extension's pieces turned down, the same model's steps run torch's operators
    and the path says so; `no-cache` re-runs the context, rows the whole-step call takes too."""
    assert _session_path(smollm2_default, "standard").endswith("fused C++ layers")
    monkeypatch.setattr(layer_module, "takes_fused", lambda h, blocks=None: False)
    monkeypatch.setattr(layer_module, "takes_fused_attention", lambda q, k, v: False)
    monkeypatch.setattr(fused_layer_module, "takes_fused", lambda h, blocks=None: False)
    monkeypatch.setattr(ffn_backend_module, "takes_fused", lambda h, blocks=None: False)
    assert _session_path(smollm2_default, "standard").endswith(
        "weights in GGUF blocks · C++ block products"
    )
    monkeypatch.setattr(linear_module, "cpu_extension", lambda: None)
    assert _session_path(smollm2_default, "standard").endswith("weights dequantised · eager torch")


def test_float_weights_and_one_token(smollm2: Model) -> None:
    """Dequantised float weights never read blocks; a run of one token has no decode step."""
    assert "weights dequantised" in _session_path(smollm2, "standard")
    assert _session_path(smollm2, "standard", steps=1) == (
        "cpu · float32 · no decode step ran (one token)"
    )


def test_bench_rows_carry_the_decode_path(smollm2_default: Model) -> None:
    ids = smollm2_default.tokenizer.encode("The capital of France is")
    with torch.inference_mode():
        row = bench_engine(
            smollm2_default,
            DenseFfn(smollm2_default),
            parse_engine("standard"),
            ids,
            BenchSettings(2, 0, 1),
        )
    path = row.as_dict()["decode_path"]
    assert path == _session_path(smollm2_default, "standard")
    assert path.startswith("cpu · float32 · ")


def test_a_batched_step_notes_its_path_in_each_session(smollm2_default: Model) -> None:
    """The server steps sessions together (`step_together`, `advance_together`): each session's
    path is what the shared step ran, as a lone session's is (`larql serve -v` logs it)."""
    from larql.inference.generation import advance_together, step_together

    model = smollm2_default
    prompts = [model.tokenizer.encode(text) for text in ("The capital of France is", "Hi")]

    def session(ids: list[int]) -> GenerationSession:
        engine = parse_engine("standard").build(model)
        return GenerationSession(engine, model, DenseFfn(model), ids, 4, stop_ids=frozenset())

    alone = _session_path(model, "standard", steps=4)
    together = [session(ids) for ids in prompts]
    for gen in together:
        gen.prefill()
    step_together(together)
    step_together(together)
    late = session(prompts[1])  # its prompt rides in the others' step
    if late.takes_prompt_in_batch(len(prompts[1])):
        advance_together([*together, late], [0, 0, len(prompts[1])])
        assert late.decode_kinds == set()  # a prompt's chunk is no decode step
    for gen in together:
        assert gen.decode_kinds or not BUILT, "a batched step noted nothing"
        done = gen.result()
        assert decode_path(model, done.decode_kinds, len(done.step_ms)) == alone
