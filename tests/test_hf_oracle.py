"""larql's forward pass against transformers on tiny random models of every supported
architecture: full-sequence logits, and the standard engine's prefill + decode steps, on prompts
longer than the sliding window."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import full_forward_logits, teacher_forced
from larql.models import load_model
from tiny_models import ARCH_CONFIGS, TinyModel, build_tiny_model, random_ids, rewrite_config

TOL = 1e-4  # × the largest logit where that is above 1 (float32 through every layer)
SEQ = 24  # > 4 × the tiny window


@pytest.fixture(scope="module", params=sorted(ARCH_CONFIGS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    pytest.importorskip("transformers")
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def tolerance(reference: torch.Tensor) -> float:
    return TOL * max(1.0, reference.abs().max().item())


def larql_logits(directory: Path, ids: list[int]) -> torch.Tensor:
    return full_forward_logits(load_model(str(directory)), ids)


def test_full_forward_matches_transformers(tiny: TinyModel) -> None:
    ids = random_ids(SEQ)
    ours = larql_logits(tiny.directory, ids)
    theirs = tiny.hf_logits(ids)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < tolerance(theirs)


def test_standard_engine_decode_matches_transformers(tiny: TinyModel) -> None:
    ids = random_ids(SEQ, seed=2)
    theirs = tiny.hf_logits(ids)
    prompt = 8
    ours = teacher_forced(load_model(str(tiny.directory)), "standard", ids, prompt)
    assert (ours - theirs[prompt - 1 :]).abs().max().item() < tolerance(theirs)


def test_sliding_layers_matter(tiny: TinyModel) -> None:
    """The tiny sliding models really exercise their window: turning it off changes logits."""
    model = load_model(str(tiny.directory))
    if all(spec.sliding_window is None for spec in model.config.layers):
        pytest.skip(f"{tiny.arch} has no sliding layers")
    ids = random_ids(SEQ)
    theirs = tiny.hf_logits(ids)
    layers = tuple(replace(spec, sliding_window=None) for spec in model.config.layers)
    model.config = replace(model.config, layers=layers)
    ours = full_forward_logits(model, ids)
    assert (ours - theirs).abs().max().item() > 1e-3


def test_transformers4_config_form(tiny: TinyModel, tmp_path: Path) -> None:
    """The same weights described the transformers-4 way (rope_theta / rope_scaling /
    sliding_window_pattern / rope_local_base_freq, no layer_types) load to the same logits."""
    import shutil

    if tiny.arch not in ("llama", "gemma3"):
        pytest.skip("only llama and gemma3 have a distinct transformers-4 form here")
    shutil.copytree(tiny.directory, tmp_path / "m")
    if tiny.arch == "llama":
        rope = dict(ARCH_CONFIGS["llama"]["rope_parameters"])
        theta = rope.pop("rope_theta")
        rewrite_config(tmp_path / "m", rope_parameters=None, rope_theta=theta, rope_scaling=rope)
    else:
        rewrite_config(
            tmp_path / "m",
            rope_parameters=None,
            layer_types=None,
            sliding_window_pattern=3,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        )
    ids = random_ids(SEQ, seed=3)
    ours = larql_logits(tmp_path / "m", ids)
    assert (ours - tiny.hf_logits(ids)).abs().max().item() < TOL


def test_gemma4_bidirectional_text_is_refused_by_name(tmp_path: Path) -> None:
    """A Gemma 4 config whose text attends both ways is refused by name, not run causally —
    through the CLI too, as a one-line error; attending both ways over vision tokens only leaves
    text causal and loads."""
    import shutil

    from typer.testing import CliRunner

    from larql.cli.app import app
    from larql.models.errors import UnsupportedArchitecture

    pytest.importorskip("transformers")
    built = build_tiny_model("gemma4", tmp_path / "core")
    for mode, refused in (("all", True), ("vision", False)):
        directory = tmp_path / mode
        shutil.copytree(built.directory, directory)
        rewrite_config(directory, use_bidirectional_attention=mode)
        if not refused:
            load_model(str(directory))
            continue
        with pytest.raises(UnsupportedArchitecture, match="bidirectional attention"):
            load_model(str(directory))
        args = ["run", "w3 w4", "--model", str(directory), "-n", "2"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code != 0
        assert "bidirectional attention" in result.output
        assert "Traceback" not in result.output
