"""`larql cache` shows where the cache of dequantised weights is and what each part holds;
`larql cache clear` removes those parts and nothing else in the directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from larql.cli.app import app
from larql.cli.cache_cmd import size
from larql.models import load_model
from larql.models.cache import cache_usage, tree_bytes
from tiny_gguf import word_gguf_tokenizer, write_gguf
from tiny_models import VOCAB, random_hf_model


def test_sizes_read_in_binary_units() -> None:
    assert [size(n) for n in (0, 1023, 1536, 538 * 2**20, 3 * 2**30)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "538.0 MiB",
        "3.0 GiB",
    ]


@pytest.mark.slow
def test_cache_shows_then_clears_what_a_load_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("LARQL_CACHE_DIR", str(cache))
    shape = dict(hidden_size=64, head_dim=16, intermediate_size=96, num_hidden_layers=2)
    model = random_hf_model("llama", vocab_size=VOCAB, tie_word_embeddings=False, **shape)
    gguf = write_gguf(model, "llama", tmp_path / "tiny.gguf", word_gguf_tokenizer(VOCAB), q8_0=True)
    load_model(str(gguf))  # dequantises into the cache
    cache.joinpath("notes.txt").write_text("not larql's")
    usage = cache_usage()
    assert set(usage) == {"weights", "tokenizers", "digests"}
    assert usage["weights"] == tree_bytes(cache / "weights") > 64 * 64 * 4  # float32 matrices
    runner = CliRunner()
    shown = runner.invoke(app, ["cache"])
    assert shown.exit_code == 0, shown.output
    assert f"cache: {cache}" in shown.stdout
    rows = {line.split()[0]: line for line in shown.stdout.splitlines()[1:-1]}
    assert set(rows) == set(usage) and size(usage["weights"]) in rows["weights"]
    cleared = runner.invoke(app, ["cache", "clear"])
    assert cleared.exit_code == 0, cleared.output
    assert f"removed {cache / 'weights'}" in cleared.stdout
    assert f"freed {size(sum(usage.values()))}" in cleared.stdout
    assert cache_usage() == {} and (cache / "notes.txt").exists()  # only larql's parts go
    again = runner.invoke(app, ["cache"])
    assert again.exit_code == 0 and "total 0 B (empty)" in again.stdout
    load_model(str(gguf))  # rebuilt when next needed
    assert "weights" in cache_usage()
