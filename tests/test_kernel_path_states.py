"""States of the engines on the Triton kernel path (`turbo-quant`, `kv-quant`, compositions with
an eviction): the path writes the torch path's state, so a state saved on either path reads
back on either (onto the kernel path where the kernels run), forks step as the engine they came
from, and the prefix cache holds and cuts them back.

On a CUDA machine the kernels run compiled; on a CPU machine, in Triton's interpreter over the
default model's first layer (tests/conftest.py turns it on); without Triton these tests skip."""

from __future__ import annotations

import pytest
import torch

import larql.kernels
from helpers import kernel_module, model_for_kernels, prefilled_engine, relative_error
from larql.inference.engine import KvEngine
from larql.inference.ffn import DenseFfn
from larql.inference.prefix_cache import PrefixCache
from larql.inference.snapshots import StateReader, StateWriter, declared_state, restore_into
from larql.kv import parse_engine
from larql.kv.turbo_quant.kernel_path import KernelPath
from larql.models import Model
from tiny_models import random_ids

TEXT = "Alice put the red ball in the box, and Bob took it out again and then " * 3


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    kernel_module("larql.kv.turbo_quant.kernels")  # skips without Triton


def restored(spec: str, model: Model, state: StateWriter, position: int) -> KvEngine:
    """A fresh engine of `spec` holding `state` at `position` tokens, as a saved state or a
    fork is read back."""
    engine = parse_engine(spec).build(model)
    assert isinstance(engine, KvEngine)
    reader = StateReader(state.fields, state.tensors, model.device)
    restore_into(engine, reader, model, position)
    reader.finish()
    return engine


@pytest.mark.parametrize(
    "spec",
    [
        "snapkv:keep=0.5,window=4+kv-quant:bits=4",
        # long: the cut and cache tests below fork turbo-quant's kernel-path state through the
        # same write and read, and the composition above runs the same round trip
        pytest.param("turbo-quant:bits=4,recent=3,sinks=2,center=1", marks=pytest.mark.long),
    ],
)
@pytest.mark.slow
def test_a_state_on_the_kernel_path_reads_back_onto_either_path(
    spec: str, smollm2: Model, monkeypatch
) -> None:
    """The kernel path writes the torch path's state: a fork stays on the kernel path and steps
    as the engine it came from; read where the kernels do not run, the state steps on the
    torch path to the kernel path's logits; a state the torch path wrote reads back onto the
    kernel path."""
    model = model_for_kernels(smollm2, monkeypatch, interpreted_layers=1)
    ids = model.tokenizer.encode(TEXT)
    ffn = DenseFfn(model)
    engine = prefilled_engine(spec, model, ids[:-4])
    with torch.inference_mode():
        engine.decode_step(model, ffn, ids[-4])  # a decoded row among those saved
        fork = engine.fork(model)
        state, held = declared_state(engine), engine.memory().state
        assert isinstance(fork._fast, KernelPath)  # type: ignore[attr-defined]
        ours = engine.decode_step(model, ffn, ids[-3])
        assert relative_error(fork.decode_step(model, ffn, ids[-3]), ours) <= 1e-6
        monkeypatch.setattr(larql.kernels, "triton_available", lambda device: False)
        on_torch = restored(spec, model, state, engine.position - 1)
        assert on_torch._fast is None  # type: ignore[attr-defined]
        assert on_torch.memory().state == held
        theirs = on_torch.decode_step(model, ffn, ids[-3])
        assert relative_error(theirs, ours) <= 1e-4
        state = declared_state(on_torch)
        monkeypatch.setattr(larql.kernels, "triton_available", lambda device: True)
        back = restored(spec, model, state, on_torch.position)
        assert isinstance(back._fast, KernelPath)  # type: ignore[attr-defined]
        assert back.memory().state == on_torch.memory().state == engine.memory().state
        assert (
            relative_error(
                back.decode_step(model, ffn, ids[-2]), on_torch.decode_step(model, ffn, ids[-2])
            )
            <= 1e-4
        )


@pytest.mark.parametrize(
    ("spec", "cuts_back"),
    [
        ("turbo-quant:bits=4", True),
        # long: a composition's fork onto the kernel path is the round trip test's above
        pytest.param("snapkv:keep=0.5,window=4+turbo-quant:bits=4", False, marks=pytest.mark.long),
    ],
)
@pytest.mark.slow
def test_the_prefix_cache_holds_kernel_path_states(
    spec: str, cuts_back: bool, smollm2: Model, monkeypatch
) -> None:
    """A prompt that extends a cached one resumes on the kernel path, stepping as the cached
    engine would; one that leaves it part-way resumes from its cut where the engine cuts back
    (a quantiser: on the kernel path too) and misses where it does not (an eviction)."""
    model = model_for_kernels(smollm2, monkeypatch, interpreted_layers=1)
    ids = model.tokenizer.encode(TEXT)
    prompt, ffn = ids[:-3], DenseFfn(model)
    engine = prefilled_engine(spec, model, prompt)
    cache = PrefixCache(2**30, min_tokens=8)
    assert cache.store(model, spec, prompt, engine)
    resumed = cache.lookup(model, spec, ids)
    assert resumed is not None and resumed.tokens == len(prompt)
    assert isinstance(resumed.engine._fast, KernelPath)  # type: ignore[attr-defined]
    with torch.inference_mode():
        ours = resumed.engine.decode_step(model, ffn, ids[-3])
        reference = engine.decode_step(model, ffn, ids[-3])
    assert relative_error(ours, reference) <= 1e-6
    leaving = cache.lookup(model, spec, prompt[:-5] + [ids[0]] * 4)
    if not cuts_back:
        assert leaving is None
        return
    assert leaving is not None and leaving.tokens == len(prompt) - 5
    assert isinstance(leaving.engine._fast, KernelPath)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "spec",
    [
        "turbo-quant:bits=4,recent=3,sinks=2,center=1",
        "kv-quant:bits=4,recent=4,sinks=2,recent_bits=8",
    ],
)
@pytest.mark.slow
def test_a_prefix_cut_from_the_kernel_path_holds_its_newest_rows_exact(
    spec: str, smollm2: Model, monkeypatch
) -> None:
    """Cut back to a prefix, a kernel-path state stays on the kernel path: the prefix's newest
    coded rows go back among its exact ones as the values their codes hold, so its next step
    is the torch path's cut (which keeps them coded) to 16-bit rounding, and its layout that
    of a layer whose rows came one at a time."""
    model = model_for_kernels(smollm2, monkeypatch, interpreted_layers=1)
    ids = model.tokenizer.encode(TEXT)
    ffn = DenseFfn(model)
    engine = prefilled_engine(spec, model, ids[:-6])
    with torch.inference_mode():
        engine.decode_step(model, ffn, ids[-6])
        state, position = declared_state(engine), engine.position
        cut = engine.fork_prefix(model, position - 8)
        assert cut is not None and cut.position == position - 8
        path = cut._fast  # type: ignore[attr-defined]
        assert isinstance(path, KernelPath)
        for layer, where in enumerate(path.layouts):
            first, end = where.recent_tokens(cut.position)
            assert len(path.exact_rows(layer)[1]) == end - first == where.recent > 0
            assert path.stored_rows(layer) == cut.position
        monkeypatch.setattr(larql.kernels, "triton_available", lambda device: False)
        reference = restored(spec, model, state, position).fork_prefix(model, position - 8)
        assert reference is not None and reference._fast is None  # type: ignore[attr-defined]
        assert len(reference._layers[0].recent) < where.recent  # type: ignore[attr-defined]
        ours = cut.decode_step(model, ffn, ids[-5])
        theirs = reference.decode_step(model, ffn, ids[-5])
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert relative_error(ours, theirs) <= 1e-3


@pytest.mark.slow
def test_a_composition_on_sliding_layers_forks_and_reads_back(
    tiny_gemma3_float32: Model, monkeypatch
) -> None:
    """Gemma 3's sliding layers hold their window by position and its full layers their kept
    rows (each laid out by its own count): a fork and a state read back both ways step as the
    engine they came from."""
    model = tiny_gemma3_float32
    if model.device.type != "cuda":
        monkeypatch.setattr(larql.kernels, "triton_available", lambda device: True)
    spec = "keydiff:keep=0.5,recent=2+turbo-quant:bits=4"
    ids = random_ids(20, seed=5)
    ffn = DenseFfn(model)
    engine = prefilled_engine(spec, model, ids[:14])
    with torch.inference_mode():
        for token in ids[14:17]:  # past the 6-key windows: their rings wrap
            engine.decode_step(model, ffn, token)
        fork, state = engine.fork(model), declared_state(engine)
        path = fork._fast  # type: ignore[attr-defined]
        assert isinstance(path, KernelPath) and path.shifted
        ours = engine.decode_step(model, ffn, ids[17])
        assert relative_error(fork.decode_step(model, ffn, ids[17]), ours) <= 1e-6
        monkeypatch.setattr(larql.kernels, "triton_available", lambda device: False)
        on_torch = restored(spec, model, state, engine.position - 1)
        assert on_torch._fast is None  # type: ignore[attr-defined]
        assert relative_error(on_torch.decode_step(model, ffn, ids[17]), ours) <= 1e-4
        state = declared_state(on_torch)
        monkeypatch.setattr(larql.kernels, "triton_available", lambda device: True)
        back = restored(spec, model, state, on_torch.position)
        assert isinstance(back._fast, KernelPath)  # type: ignore[attr-defined]
        assert back._fast.offsets == path.offsets  # type: ignore[attr-defined]
        assert (
            relative_error(
                back.decode_step(model, ffn, ids[18]), on_torch.decode_step(model, ffn, ids[18])
            )
            <= 1e-4
        )
