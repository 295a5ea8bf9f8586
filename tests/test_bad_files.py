"""Bad files through every loader: a truncated, random or crafted GGUF, a broken HF directory, a
corrupted boundary archive or apollo store is refused with one `LarqlError` line naming the
file — never another exception, and never an allocation sized by a crafted header (each such
header here declares terabytes; a loader that believed it would fail or hang, not refuse).

The hypothesis tests mutate the headers (GGUF bytes and metadata values, config.json values,
frame metadata, store manifests): each mutation either loads — and a loaded model then decodes
a token — or is refused so."""

from __future__ import annotations

import io
import json
import struct
import zipfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from numpy.lib import format as np_format
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from larql.cli.app import app
from larql.errors import LarqlError
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate
from larql.kv import parse_engine
from larql.kv.apollo.store import ENTRY_DTYPE, ApolloStore, ArchConfig, StoreManifest
from larql.kv.boundary import DirectoryBoundaryArchive
from larql.kv.boundary.archive import METADATA_KEY, frame_file_name
from larql.kv.boundary.frames import (
    Agreement,
    BoundaryFrame,
    BoundaryMetadata,
    BoundaryModelIdentity,
    BoundaryPayload,
    PayloadContract,
)
from larql.models import Model, load_model
from tiny_gguf import rewrite_gguf, word_gguf_tokenizer, write_gguf
from tiny_models import VOCAB, build_tiny_model, random_hf_model, rewrite_config

HYPOTHESIS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
TERA = 1 << 40


@pytest.fixture(scope="module", autouse=True)
def fresh_cache(tmp_path_factory: pytest.TempPathFactory):
    """Every mutated file is new bytes: keep their dequantized weights out of the user cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LARQL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


def refused(path: Path, load: Callable[[], object]) -> str:
    """`load()` raises a `LarqlError` of one line naming `path`; its message."""
    with pytest.raises(LarqlError) as raised:
        load()
    return checked_message(raised.value, path)


def checked_message(error: BaseException, path: Path) -> str:
    message = str(error)
    assert "\n" not in message, message
    assert str(path) in message, f"{message!r} does not name {path}"
    return message


def loads_or_refuses(path: Path, load: Callable[[], Any]) -> Any:
    """What `load()` gives, or None where it raised a one-line `LarqlError` naming `path`
    (any other exception fails the test)."""
    try:
        loaded = load()
    except LarqlError as e:
        checked_message(e, path)
        event(f"refused: {type(e).__name__}")
        return None
    event("loaded")
    return loaded


def decodes(model: Model) -> None:
    """A loaded model runs: a greedy token after two (none where its context is that short)."""
    engine = parse_engine("standard").build(model)
    out = generate(engine, model, DenseFfn(model), [1, 2], 1, stop_ids=frozenset())
    assert all(0 <= t < model.config.vocab_size for t in out.tokens)


# ---------------------------------------------------------------------------- GGUF files


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama GGUF (2 layers, its matrices in Q8_0 blocks, a SentencePiece vocabulary)
    that loads and runs."""
    shape = dict(hidden_size=64, head_dim=16, intermediate_size=96, num_hidden_layers=2)
    model = random_hf_model("llama", vocab_size=VOCAB, tie_word_embeddings=False, **shape)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(model, "llama", path, word_gguf_tokenizer(VOCAB), permute_qk=True, q8_0=True)
    decodes(load_model(str(path)))
    return path


def header_end(path: Path) -> int:
    """Where the tensor data starts (the header is everything before)."""
    from larql.models.gguf_file import GgufFile

    return min(info.offset for info in GgufFile(path).tensors.values())


def gguf_bytes(
    kv: list[tuple[str, int, bytes]] = (),  # type: ignore[assignment]
    tensors: list[tuple[str, tuple[int, ...], int, int]] = (),  # type: ignore[assignment]
    data: bytes = b"",
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
) -> bytes:
    """A GGUF byte by byte: metadata (key, value type, packed value), tensors (name, dims in
    GGUF order, type, offset), then `data` at 32-byte alignment; counts may lie."""
    out = b"GGUF" + struct.pack(
        "<IQQ",
        version,
        len(tensors) if n_tensors is None else n_tensors,
        len(kv) if n_kv is None else n_kv,
    )
    for key, vtype, value in kv:
        out += _string(key) + struct.pack("<I", vtype) + value
    for name, dims, qtype, offset in tensors:
        out += _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, qtype, offset)
    out += b"\0" * (-len(out) % 32)
    return out + data


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


U32, STRING, ARRAY = 4, 8, 9
F32 = 0
ARCH = ("general.architecture", STRING, _string("llama"))
CRAFTED_GGUFS: dict[str, tuple[bytes, str]] = {
    "the 8 bytes of a header start": (b"GGUF\x03\x00\x00\x00", "truncated"),
    "empty": (b"", "not a GGUF file"),
    "wrong magic": (b"GGML" + bytes(60), "not a GGUF file"),
    "version 1": (gguf_bytes(version=1), "version 1 is not supported"),
    "big-endian version": (gguf_bytes(version=3 << 24), "is not supported"),
    "a terabyte of tensors": (gguf_bytes(n_tensors=TERA), "tensor count"),
    "a terabyte of keys": (gguf_bytes(n_kv=TERA), "metadata key count"),
    "a terabyte-long key": (
        b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, TERA) + bytes(32),
        "the length of metadata key",
    ),
    "a terabyte-long string": (
        gguf_bytes([("general.name", STRING, struct.pack("<Q", TERA))]),
        "general.name",
    ),
    "a terabyte-long array": (
        gguf_bytes([("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, TERA))]),
        "tokenizer.ggml.tokens",
    ),
    "arrays nested without end": (
        gguf_bytes([("x", ARRAY, struct.pack("<IQ", ARRAY, 1) * 1000)]),
        "nests arrays",
    ),
    "an unknown value type": (gguf_bytes([("x", 99, b"\0" * 8)]), "unknown value type"),
    "a tensor of 5 dimensions": (gguf_bytes([ARCH], [("t", (1,) * 5, F32, 0)]), "dimensions"),
    "a tensor of an unknown type": (gguf_bytes([ARCH], [("t", (4,), 200, 0)]), "unknown type"),
    "a tensor past the end": (
        gguf_bytes([ARCH], [("t", (1 << 20, 1 << 20), F32, 0)], data=bytes(64)),
        "runs past the end",
    ),
    "a tensor at a misaligned offset": (
        gguf_bytes([ARCH], [("t", (4,), F32, 3)], data=bytes(64)),
        "not aligned",
    ),
    "a tensor with a zero dimension": (
        gguf_bytes([ARCH], [("t", (0, 4), F32, 0)], data=bytes(64)),
        "every dimension",
    ),
    "a tensor listed twice": (
        gguf_bytes([ARCH], [("t", (4,), F32, 0), ("t", (4,), F32, 0)], data=bytes(64)),
        "listed twice",
    ),
    "an alignment of 0": (
        gguf_bytes([ARCH, ("general.alignment", U32, struct.pack("<I", 0))]),
        "general.alignment",
    ),
    "no model keys": (gguf_bytes([ARCH]), "llama.embedding_length is missing"),
    "an architecture larql does not run": (
        gguf_bytes([("general.architecture", STRING, _string("falcon"))]),
        "'falcon'",
    ),
}


@pytest.mark.parametrize("case", CRAFTED_GGUFS, ids=list(CRAFTED_GGUFS))
def test_crafted_gguf_headers_are_refused(case: str, tmp_path: Path) -> None:
    content, fragment = CRAFTED_GGUFS[case]
    path = tmp_path / "crafted.gguf"
    path.write_bytes(content)
    assert fragment in refused(path, lambda: load_model(str(path)))


def test_random_bytes_are_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    assert "bad magic" in refused(path, lambda: load_model(str(path)))
    path.write_bytes(b"GGUF" + np.random.default_rng(1).bytes(4096))  # the magic, then noise
    refused(path, lambda: load_model(str(path)))


def test_every_truncation_of_a_gguf_is_refused(gguf_file: Path, tmp_path: Path) -> None:
    content = gguf_file.read_bytes()
    end = header_end(gguf_file)
    cuts = [4, 8, 12, 23, 24, 40, 200, end // 2, end - 1, end, end + 7, len(content) - 1]
    for cut in cuts:
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(content[:cut])
        refused(path, lambda path=path: load_model(str(path)))


GGUF_METADATA_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "no embedding_length": ({"llama.embedding_length": None}, "llama.embedding_length is missing"),
    "no block_count": ({"llama.block_count": None}, "llama.block_count is missing"),
    "no head_count": ({"llama.attention.head_count": None}, "head_count is missing"),
    "no feed_forward_length": ({"llama.feed_forward_length": None}, "feed_forward_length"),
    "a string for a size": ({"llama.embedding_length": "48"}, "expected an integer"),
    "an array for a size": ({"llama.block_count": [2, 2]}, "expected an integer"),
    "a trillion layers": ({"llama.block_count": TERA}, "out of range"),
    "a billion heads": ({"llama.attention.head_count": 1 << 30}, "out of range"),
    "no heads": ({"llama.attention.head_count": 0}, "out of range"),
    "more K/V heads than heads": ({"llama.attention.head_count_kv": 5}, "head_count_kv"),
    "K/V heads that do not divide": ({"llama.attention.head_count_kv": 3}, "not divisible"),
    "a context of a terabyte": ({"llama.context_length": TERA}, "context_length"),
    "a huge vocabulary": ({"llama.vocab_size": 1 << 30}, "vocab_size"),
    "a vocabulary the embedding does not have": ({"llama.vocab_size": VOCAB + 1}, "token_embd"),
    "more layers than tensors": ({"llama.block_count": 3}, "no tensors for layer 2"),
    "fewer layers than tensors": ({"llama.block_count": 1}, "blk.1"),
    "a width the tensors do not have": ({"llama.embedding_length": 80}, "has shape"),
    "a head width the tensors do not have": ({"llama.attention.key_length": 32}, "has shape"),
    "an odd rotary width": ({"llama.rope.dimension_count": 7}, "odd"),
    "a rotary width past the head": ({"llama.rope.dimension_count": 32}, "out of range"),
    "a RoPE base of NaN": ({"llama.rope.freq_base": float("nan")}, "rope.freq_base"),
    "an unknown RoPE scaling": ({"llama.rope.scaling.type": "su"}, "'su'"),
    "a bos id past the vocabulary": ({"tokenizer.ggml.bos_token_id": VOCAB}, "bos_token_id"),
    "no tokens": ({"tokenizer.ggml.tokens": None}, "no tokenizer"),
    "tokens that are numbers": ({"tokenizer.ggml.tokens": list(range(VOCAB))}, "strings"),
    "token types of another length": (
        {"tokenizer.ggml.token_type": np.ones(3, np.int32)},
        "token_type",
    ),
    "an unknown tokenizer": ({"tokenizer.ggml.model": "bert"}, "'bert'"),
    "a chat template that is a number": ({"tokenizer.chat_template": 3}, "chat_template"),
}


@pytest.mark.parametrize("case", GGUF_METADATA_CASES, ids=list(GGUF_METADATA_CASES))
def test_gguf_metadata_a_model_cannot_follow_is_refused(
    case: str, gguf_file: Path, tmp_path: Path
) -> None:
    changes, fragment = GGUF_METADATA_CASES[case]
    path = rewrite_gguf(gguf_file, tmp_path / "changed.gguf", changes)
    assert fragment in refused(path, lambda: load_model(str(path)))


def test_a_gguf_whose_last_tensor_is_cut_off(gguf_file: Path, tmp_path: Path) -> None:
    path = tmp_path / "short.gguf"
    path.write_bytes(gguf_file.read_bytes()[:-100])
    assert "runs past the end of the file" in refused(path, lambda: load_model(str(path)))


def test_rewriting_unchanged_keeps_a_loadable_model(gguf_file: Path, tmp_path: Path) -> None:
    """The rewrite the metadata cases go through changes nothing else."""
    copy = load_model(str(rewrite_gguf(gguf_file, tmp_path / "same.gguf", {})))
    original = load_model(str(gguf_file))
    assert replace(copy.config, name=original.config.name) == original.config
    assert torch.equal(copy.weights.embed, original.weights.embed)


@HYPOTHESIS
@given(data=st.data())
def test_mutated_gguf_header_bytes_load_or_are_refused(
    gguf_file: Path, tmp_path: Path, data: st.DataObject
) -> None:
    content = bytearray(gguf_file.read_bytes())
    end = header_end(gguf_file)
    for _ in range(data.draw(st.integers(1, 6))):
        at = data.draw(st.integers(0, end - 1))
        content[at] = data.draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x01])) ^ (
            content[at] if data.draw(st.booleans()) else 0
        )
    path = tmp_path / "mutated.gguf"
    path.write_bytes(bytes(content))
    model = loads_or_refuses(path, lambda: load_model(str(path)))
    if model is not None:
        decodes(model)


JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.integers(-4, 300)
    | st.just(10**400)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
NAMES = st.sampled_from(["none", "linear", "yarn", "gpt2", "llama", "qwen2", "a b", "▁w"])
GGUF_VALUES = (
    st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.integers(0, 300)
    | st.floats(width=32)
    | st.text(max_size=8)
    | NAMES
    | st.lists(st.integers(0, 300), min_size=1, max_size=4)
    | st.lists(st.text(max_size=4) | NAMES, min_size=1, max_size=VOCAB + 2)
)
NUMBERS = st.integers(-3, 70_000) | st.floats(allow_nan=True, allow_infinity=True)
# RoPE parameters as a config writes them, their values anything numeric
ROPE_PARAMETERS = st.fixed_dictionaries(
    {
        "rope_type": st.sampled_from(
            ["default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional", "su"]
        ),
        "rope_theta": NUMBERS,
    },
    optional={
        key: NUMBERS
        for key in (
            "factor",
            "original_max_position_embeddings",
            "low_freq_factor",
            "high_freq_factor",
            "beta_fast",
            "beta_slow",
            "attention_factor",
            "mscale",
            "mscale_all_dim",
            "partial_rotary_factor",
        )
    }
    | {
        "short_factor": st.lists(NUMBERS, max_size=8),
        "long_factor": st.lists(NUMBERS, max_size=8),
        "truncate": JSON_SCALARS,
    },
)


# keys the tiny file does not have, that a mutation may add
OPTIONAL_GGUF_KEYS = [
    "llama.vocab_size",
    "llama.attention.sliding_window",
    "llama.rope.scaling.type",
    "llama.rope.scaling.factor",
    "llama.expert_count",
    "llama.residual_scale",
    "llama.logit_scale",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.merges",
]


@HYPOTHESIS
@given(data=st.data())
def test_mutated_gguf_metadata_values_load_or_are_refused(
    gguf_file: Path, tmp_path: Path, data: st.DataObject
) -> None:
    from larql.models.gguf_file import GgufFile

    keys = sorted(k for k in GgufFile(gguf_file).metadata if k != "general.alignment")
    changes = {
        data.draw(st.sampled_from(keys + OPTIONAL_GGUF_KEYS)): data.draw(st.none() | GGUF_VALUES)
        for _ in range(data.draw(st.integers(1, 3)))
    }
    path = rewrite_gguf(gguf_file, tmp_path / "mutated.gguf", changes)
    model = loads_or_refuses(path, lambda: load_model(str(path), weights="float"))
    if model is not None:
        decodes(model)


# ---------------------------------------------------------------------------- HF directories


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama HF directory (2 layers) that loads and runs."""
    directory = tmp_path_factory.mktemp("hf") / "tiny"
    build_tiny_model("llama", directory, num_hidden_layers=2)
    decodes(load_model(str(directory)))
    return directory


def hf_copy(hf_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    copy.mkdir()
    for file in hf_dir.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    return copy


CONFIG_FILES: dict[str, tuple[str, str]] = {
    "sizes missing": ('{"model_type": "llama"}', "hidden_size is missing"),
    "empty": ("", "cannot read"),
    "not JSON": ("{hidden_size: 48", "cannot read"),
    "not UTF-8": ("\udcff", "cannot read"),
    "a list": ("[1, 2]", "not a JSON object"),
    "a string": ('"llama"', "not a JSON object"),
    "nested past the parser": ("[" * 100_000, "cannot read"),
    "an unknown model type": ('{"model_type": "bert"}', "'bert'"),
}


@pytest.mark.parametrize("case", CONFIG_FILES, ids=list(CONFIG_FILES))
def test_broken_config_json_is_refused(case: str, hf_dir: Path, tmp_path: Path) -> None:
    directory = hf_copy(hf_dir, tmp_path)
    text, fragment = CONFIG_FILES[case]
    (directory / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    message = refused(directory / "config.json", lambda: load_model(str(directory)))
    assert fragment in message


CONFIG_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "no hidden_size": ({"hidden_size": None}, "hidden_size is missing"),
    "no vocab_size": ({"vocab_size": None}, "vocab_size is missing"),
    "a string size": ({"hidden_size": "48"}, "expected an integer"),
    "a negative size": ({"intermediate_size": -80}, "out of range"),
    "a trillion layers": ({"num_hidden_layers": TERA}, "out of range"),
    "no heads": ({"num_attention_heads": 0}, "out of range"),
    "more heads than width": ({"num_attention_heads": 64, "head_dim": None}, "head_dim"),
    "a context of a terabyte": ({"max_position_embeddings": TERA}, "out of range"),
    "layer types of another length": ({"layer_types": ["full_attention"]}, "layer_types"),
    "an unknown layer type": ({"layer_types": ["linear_attention"] * 2}, "linear_attention"),
    "rope_scaling a string": ({"rope_scaling": "yarn", "rope_parameters": None}, "rope_scaling"),
    "a rope base that is text": ({"rope_parameters": {"rope_theta": "x"}}, "rope_theta"),
    "an eos id past the vocabulary": ({"eos_token_id": 10**6}, "eos_token_id"),
    "a softcap of zero": ({"final_logit_softcapping": 0}, "final_logit_softcapping"),
    "quantization settings of a list": ({"quantization_config": [1]}, "quantization_config"),
}


@pytest.mark.parametrize("case", CONFIG_VALUES, ids=list(CONFIG_VALUES))
def test_config_values_a_model_cannot_follow_are_refused(
    case: str, hf_dir: Path, tmp_path: Path
) -> None:
    directory = hf_copy(hf_dir, tmp_path)
    changes, fragment = CONFIG_VALUES[case]
    _set_config(directory, changes)
    assert fragment in refused(directory / "config.json", lambda: load_model(str(directory)))


def _set_config(directory: Path, changes: dict[str, Any]) -> None:
    raw = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        raw[key] = value  # None stays: a null reads as absent
    (directory / "config.json").write_text(json.dumps(raw))


def test_a_config_whose_sizes_the_weights_do_not_have(hf_dir: Path, tmp_path: Path) -> None:
    directory = hf_copy(hf_dir, tmp_path)
    rewrite_config(directory, hidden_size=64, head_dim=16)
    message = refused(directory, lambda: load_model(str(directory)))
    assert "has shape" in message and "config.json implies" in message


def _rewrite_weights(directory: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    (weights,) = directory.glob("*.safetensors")
    state = load_file(weights)
    edit(state)
    save_file(state, str(weights))


SAFETENSORS_CASES: dict[str, tuple[Callable[[dict[str, torch.Tensor]], None], str]] = {
    "a matrix of another shape": (
        lambda s: s.update({"model.layers.1.self_attn.o_proj.weight": torch.zeros(48, 47)}),
        "has shape",
    ),
    "a norm of another shape": (
        lambda s: s.update({"model.norm.weight": torch.zeros(3)}),
        "has shape",
    ),
    "integer weights": (
        lambda s: s.update(
            {"model.layers.0.mlp.up_proj.weight": torch.zeros(80, 48, dtype=torch.int64)}
        ),
        "I64",
    ),
    "a missing tensor": (lambda s: s.pop("model.layers.1.mlp.down_proj.weight"), "missing tensor"),
    "no LM head in an untied model": (lambda s: s.pop("lm_head.weight"), "lm_head"),
}


@pytest.mark.parametrize("case", SAFETENSORS_CASES, ids=list(SAFETENSORS_CASES))
def test_weights_that_do_not_fit_the_config_are_refused(
    case: str, hf_dir: Path, tmp_path: Path
) -> None:
    directory = hf_copy(hf_dir, tmp_path)
    edit, fragment = SAFETENSORS_CASES[case]
    _rewrite_weights(directory, edit)
    assert fragment in refused(directory, lambda: load_model(str(directory)))


def test_broken_safetensors_files_are_refused(hf_dir: Path, tmp_path: Path) -> None:
    directory = hf_copy(hf_dir, tmp_path)
    (weights,) = directory.glob("*.safetensors")
    content = weights.read_bytes()
    for broken in (b"", b"garbage", content[: len(content) // 2], struct.pack("<Q", TERA)):
        weights.write_bytes(broken)
        assert "safetensors" in refused(directory, lambda: load_model(str(directory)))
    weights.unlink()
    assert "no *.safetensors" in refused(directory, lambda: load_model(str(directory)))


TOKENIZER_FILES: dict[str, tuple[bytes, str]] = {
    "not JSON": (b"{", "tokenizer"),
    "JSON but no tokenizer": (b'{"model": 3}', "tokenizer"),
    "ids past the vocabulary": (
        json.dumps(
            {
                "version": "1.0",
                "model": {"type": "WordLevel", "unk_token": "a", "vocab": {"a": 0, "b": 10_000}},
            }
        ).encode(),
        "past the model's vocab_size",
    ),
}


@pytest.mark.parametrize("case", TOKENIZER_FILES, ids=list(TOKENIZER_FILES))
def test_broken_tokenizer_json_is_refused(case: str, hf_dir: Path, tmp_path: Path) -> None:
    directory = hf_copy(hf_dir, tmp_path)
    content, fragment = TOKENIZER_FILES[case]
    (directory / "tokenizer.json").write_bytes(content)
    message = refused(directory / "tokenizer.json", lambda: load_model(str(directory)))
    assert fragment in message


def test_a_broken_chat_template_file_is_refused(hf_dir: Path, tmp_path: Path) -> None:
    directory = hf_copy(hf_dir, tmp_path)
    (directory / "tokenizer_config.json").write_text("{not json")
    assert "chat template" in refused(directory, lambda: load_model(str(directory)))


CONFIG_KEYS = [
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "hidden_act",
    "sliding_window",
    "layer_types",
    "attn_logit_softcapping",
    "query_pre_attn_scalar",
    "partial_rotary_factor",
    "num_local_experts",
    "per_layer_config",
    "num_kv_shared_layers",
]


@HYPOTHESIS
@given(data=st.data())
def test_mutated_config_json_loads_or_is_refused(
    hf_dir: Path, tmp_path: Path, data: st.DataObject
) -> None:
    directory = tmp_path / "model"
    if not directory.exists():
        directory = hf_copy(hf_dir, tmp_path)
    raw = json.loads((hf_dir / "config.json").read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(CONFIG_KEYS))
        if data.draw(st.booleans()):
            raw.pop(key, None)
        else:
            raw[key] = data.draw(ROPE_PARAMETERS if key == "rope_parameters" else JSON_VALUES)
    (directory / "config.json").write_text(json.dumps(raw))
    model = loads_or_refuses(directory, lambda: load_model(str(directory)))
    if model is not None:
        decodes(model)


# ---------------------------------------------------------------------------- boundary archives


def frame(token_end: int, hidden: int = 8) -> BoundaryFrame:
    row = torch.randn(hidden, generator=torch.Generator().manual_seed(token_end))
    from larql.kv.boundary import codecs

    metadata = BoundaryMetadata(3, 1.5, 4, 0.5, 1.0, 0.7, 0.6, Agreement.AGREES, False, False, "a")
    return BoundaryFrame(
        version=2,
        identity=BoundaryModelIdentity("tiny", "r1", "t1", "llama"),
        sequence_id="seq",
        boundary_id=f"seq:{token_end}",
        token_start=token_end - 4,
        token_end=token_end,
        layer=1,
        hidden_size=hidden,
        metadata=metadata,
        payload=BoundaryPayload("bf16", codecs.encode("bf16", row), PayloadContract.CALIBRATING),
        run_id="run",
    )


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    root = tmp_path / "frames"
    store = DirectoryBoundaryArchive(root)
    for end in (4, 8):
        store.append(frame(end))
    assert len(DirectoryBoundaryArchive(root).frames()) == 2
    return root


def write_frame(path: Path, doc: Any, payload: torch.Tensor | None) -> None:
    tensors = {} if payload is None else {"payload": payload}
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(doc)} if doc else None)


def good_doc() -> dict[str, Any]:
    return frame(4).to_json()


def good_payload() -> torch.Tensor:
    return torch.frombuffer(bytearray(frame(4).payload.data), dtype=torch.uint8)


FRAME_CASES: dict[str, Callable[[Path], None]] = {
    "not safetensors": lambda p: p.write_bytes(b"garbage"),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-5]),
    "a terabyte header": lambda p: p.write_bytes(struct.pack("<Q", TERA) + b"{}"),
    "no metadata": lambda p: write_frame(p, None, good_payload()),
    "metadata not JSON": lambda p: save_file(
        {"payload": good_payload()}, str(p), metadata={METADATA_KEY: "{"}
    ),
    "metadata a list": lambda p: write_frame(p, [1], good_payload()),
    "no payload": lambda p: write_frame(p, good_doc(), None),
    "a float payload": lambda p: write_frame(p, good_doc(), torch.zeros(4)),
    "another version": lambda p: write_frame(p, {**good_doc(), "version": 99}, good_payload()),
    "a token_end of text": lambda p: write_frame(
        p, {**good_doc(), "token_end": "8"}, good_payload()
    ),
    "an unknown codec": lambda p: write_frame(
        p, {**good_doc(), "payload": {**good_doc()["payload"], "codec": "zip"}}, good_payload()
    ),
    "a payload of another width": lambda p: write_frame(
        p, {**good_doc(), "hidden_size": 9}, good_payload()
    ),
    "payload bytes that disagree": lambda p: write_frame(
        p, {**good_doc(), "payload": {**good_doc()["payload"], "bytes": 3}}, good_payload()
    ),
}


@pytest.mark.parametrize("case", FRAME_CASES, ids=list(FRAME_CASES))
def test_corrupted_boundary_frames_are_refused(case: str, archive: Path) -> None:
    path = archive / frame_file_name("seq", 4)
    FRAME_CASES[case](path)
    refused(path, lambda: DirectoryBoundaryArchive(archive).frames())


FRAME_KEYS = [
    "version",
    "identity",
    "sequence_id",
    "boundary_id",
    "token_start",
    "token_end",
    "layer",
    "hidden_size",
    "metadata",
    "payload",
    "fallback_policy",
    "run_id",
]


@HYPOTHESIS
@given(data=st.data())
def test_mutated_frame_metadata_loads_or_is_refused(archive: Path, data: st.DataObject) -> None:
    doc = good_doc()
    for _ in range(data.draw(st.integers(1, 3))):
        target = doc
        key = data.draw(st.sampled_from(FRAME_KEYS))
        if isinstance(doc.get(key), dict) and data.draw(st.booleans()):
            target, key = doc[key], data.draw(st.sampled_from(sorted(doc[key]) or ["x"]))
        if data.draw(st.booleans()):
            target.pop(key, None)
        else:
            target[key] = data.draw(JSON_VALUES)
    path = archive / frame_file_name("seq", 4)
    write_frame(path, doc, good_payload())
    frames = loads_or_refuses(path, lambda: DirectoryBoundaryArchive(archive).frames())
    if frames is not None:
        for f in frames:
            if f.payload.codec != "none":
                assert f.residual().shape == (f.hidden_size,)


# ---------------------------------------------------------------------------- apollo stores

HIDDEN = 4


MANIFEST = StoreManifest(
    version=1,
    model="tiny",
    hidden_size=HIDDEN,
    num_entries=2,
    num_windows=2,
    num_tokens=5,
    entries_per_window=4,
    crystal_layer=1,
    window_size=3,
    arch_config=ArchConfig(2, 0, 1, 10.0),
    has_residuals=True,
)


def apollo_store(directory: Path) -> Path:
    """A 2-window store with residuals (`MANIFEST`), written to `directory`."""
    tokens = [np.array([5, 6, 7], np.uint32), np.array([8, 9], np.uint32)]
    entries = np.zeros(2, ENTRY_DTYPE)
    entries["token_id"], entries["window_id"], entries["position_in_window"] = (
        [6, 9],
        [0, 1],
        [1, 1],
    )
    boundaries = np.arange(2 * HIDDEN, dtype=np.float32).reshape(2, HIDDEN)
    ApolloStore(MANIFEST, tokens, entries, boundaries).save(directory)
    return directory


def npy_header_bytes(shape: tuple[int, ...], dtype: Any = "<f4") -> bytes:
    """The header numpy writes for an array of `shape` (its descr `dtype`), without the data."""
    buffer = io.BytesIO()
    np_format.write_array_header_1_0(
        buffer, {"descr": dtype, "fortran_order": False, "shape": shape}
    )
    return buffer.getvalue()


def _npz(path: Path, members: dict[str, bytes], method: int = zipfile.ZIP_STORED) -> None:
    with zipfile.ZipFile(path, "w", compression=method) as archive:
        for name, content in members.items():
            archive.writestr(name, content)


STORE_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "a boundary declaring a terabyte": (
        lambda d: (d / "boundaries" / "window_000.npy").write_bytes(
            npy_header_bytes((TERA,)) + bytes(16)
        ),
        "window_000.npy",
    ),
    "a token list declaring a terabyte": (
        lambda d: _npz(
            d / "window_token_lists.npz",
            {
                "0.npy": npy_header_bytes((TERA,), "<u4") + bytes(12),
                "1.npy": npy_header_bytes((2,), "<u4") + bytes(8),
            },
        ),
        "window_token_lists.npz",
    ),
    "a compressed member declaring a terabyte": (
        lambda d: _npz(
            d / "entries.npz",
            {"entries.npy": npy_header_bytes((TERA,), ENTRY_DTYPE.descr)},
            zipfile.ZIP_DEFLATED,
        ),
        "entries.npz",
    ),
    "a member that is not an array": (
        lambda d: _npz(d / "entries.npz", {"entries.txt": b"x" * 64}),
        "entries.npz",
    ),
    "a pickled array": (
        lambda d: np.save(d / "boundary_residual.npy", np.array([object()]), allow_pickle=True),
        "boundary_residual.npy",
    ),
    "manifest not JSON": (lambda d: (d / "manifest.json").write_text("{"), "manifest.json"),
    "manifest counts past any store": (
        lambda d: (d / "manifest.json").write_text(
            json.dumps({**json.loads((d / "manifest.json").read_text()), "hidden_size": 10**30})
        ),
        "hidden_size",
    ),
}


@pytest.mark.parametrize("case", STORE_CASES, ids=list(STORE_CASES))
def test_corrupted_apollo_stores_are_refused(case: str, tmp_path: Path) -> None:
    directory = apollo_store(tmp_path / "store")
    ApolloStore.load(directory)
    break_it, fragment = STORE_CASES[case]
    break_it(directory)
    assert fragment in refused(directory, lambda: ApolloStore.load(directory))


MANIFEST_KEYS = [
    "version",
    "model",
    "hidden_size",
    "num_entries",
    "num_windows",
    "num_tokens",
    "entries_per_window",
    "crystal_layer",
    "window_size",
    "arch_config",
    "has_residuals",
]


@HYPOTHESIS
@given(data=st.data())
def test_mutated_store_manifests_load_or_are_refused(tmp_path: Path, data: st.DataObject) -> None:
    directory = tmp_path / "store"
    if not directory.exists():
        apollo_store(directory)
    raw = MANIFEST.to_json()
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(MANIFEST_KEYS))
        if data.draw(st.booleans()):
            raw.pop(key, None)
        else:
            raw[key] = data.draw(JSON_VALUES | st.integers(0, 8))
    (directory / "manifest.json").write_text(json.dumps(raw))
    store = loads_or_refuses(directory, lambda: ApolloStore.load(directory))
    if store is not None:
        assert store.total_bytes() > 0


# ---------------------------------------------------------------------------- the CLI


@pytest.fixture
def cli():
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


def assert_one_error_line(result: Any, path: Path) -> None:
    """Exit 2 (an unexpected exception exits 1), one `error:` line naming `path`."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and str(path) in line


def test_run_with_a_truncated_gguf_is_one_error_line(cli, tmp_path: Path) -> None:
    path = tmp_path / "trunc.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert_one_error_line(cli("run", "Hi", "-n", "2", "-m", str(path)), path)


def test_run_with_a_config_without_sizes_is_one_error_line(cli, tmp_path: Path) -> None:
    directory = tmp_path / "half"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "llama"}')
    result = cli("run", "Hi", "-n", "2", "-m", str(directory))
    assert_one_error_line(result, directory / "config.json")
    assert "hidden_size" in result.stderr


def test_run_with_a_huge_block_count_is_one_error_line(
    cli, gguf_file: Path, tmp_path: Path
) -> None:
    path = rewrite_gguf(gguf_file, tmp_path / "deep.gguf", {"llama.block_count": 1 << 62})
    assert_one_error_line(cli("run", "Hi", "-n", "2", "-m", str(path)), path)


def test_boundary_ls_of_a_corrupted_archive_is_one_error_line(cli, archive: Path) -> None:
    path = archive / frame_file_name("seq", 8)
    path.write_bytes(path.read_bytes()[:-3])
    assert_one_error_line(cli("boundary", "ls", str(archive)), path)
