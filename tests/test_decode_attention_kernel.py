"""The Triton split-key decode attention (`larql.kernels.decode_attention`) against a float64
reference, and the static-cache engine that uses it against the eager `standard`.

On a CUDA machine the kernels run compiled; on a CPU machine with Triton installed they run in
Triton's interpreter (float32 and float16: the interpreter mishandles bfloat16, which the CUDA
tests cover); without Triton these tests skip (a CPU install of torch brings none)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

import larql.kernels
from helpers import first_layers, kernel_module, model_for_kernels, relative_error
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate, teacher_forced_logits
from larql.kv import parse_engine
from larql.kv.spec import MalformedEngineSpec
from larql.kv.standard import StandardEngine
from larql.models import Model
from larql.models.model import load_model

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
PROMPT = "Alice put the red ball in the box, and Bob"


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return kernel_module("larql.kernels.decode_attention")


def reference(q, keys, values, position: int, scale: float, window: int, softcap: float):
    """float64 attention of one query per head over rows 0..C-1 → [Hq, 1, D]."""
    group = q.shape[0] // keys.shape[0]
    k = keys.double().repeat_interleave(group, 0)  # [Hq, C, D]
    v = values.double().repeat_interleave(group, 0)
    scores = q.double() @ k.transpose(1, 2) * scale  # [Hq, 1, C]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    rows = torch.arange(keys.shape[1], device=keys.device)
    seen = rows <= position
    if window:
        seen &= (position - rows) < window
    return torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ v


SHAPES = [
    # Hq, Hkv, D, capacity, position, window, softcap
    (9, 3, 64, 1024, 600, 0, 0.0),  # SmolLM2's heads, the static cache after a 512 prompt
    (9, 3, 64, 256, 0, 0, 0.0),  # the first position: one key
    (9, 3, 64, 256, 255, 0, 0.0),  # the last row of the buffer
    (4, 1, 32, 16384, 16000, 0, 0.0),  # 256 blocks: several blocks per split
    (4, 1, 32, 2560, 2000, 0, 0.0),  # 40 splits: the merge's last tile of splits part-filled
    (4, 1, 32, 40960, 40000, 0, 0.0),  # 5 blocks a split: a loop, not unrolled
    (8, 2, 80, 512, 300, 50, 0.0),  # a head width padded to 128, a window
    (4, 4, 16, 128, 90, 0, 0.0),  # no grouping
    (9, 3, 64, 64, 40, 0, 0.0),  # one split: its state is the output
    (4, 2, 64, 256, 200, 0, 30.0),  # soft-capped scores (Gemma 2)
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16 if CUDA else torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_kernel_equals_float64_attention(kernels, shape, dtype) -> None:
    heads, kv_heads, dim, capacity, position, window, softcap = shape
    generator = torch.Generator().manual_seed(sum(shape[:5]))

    def draw(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(DEVICE, dtype)

    q, keys, values = (
        draw(heads, 1, dim),
        draw(kv_heads, capacity, dim),
        draw(kv_heads, capacity, dim),
    )
    pos = torch.tensor([position], device=DEVICE)
    scale = dim**-0.5
    out = kernels.decode_attention(q, keys, values, pos, scale, window, softcap)
    expected = reference(q, keys, values, position, scale, window, softcap)
    assert out.shape == (heads, 1, dim) and out.dtype == dtype
    assert relative_error(out, expected) <= TOLERANCE[dtype]


def test_the_last_split_of_each_head_merges_and_leaves_the_counts_at_zero(kernels) -> None:
    """One launch: the last of a head's splits to finish merges them and sets the head's count
    back to 0, so the next launch (here of another shape, sharing the counters) counts afresh."""
    generator = torch.Generator().manual_seed(5)
    for heads, kv_heads, capacity, position in ((9, 3, 1024, 700), (8, 8, 512, 511)):
        q = torch.randn(heads, 1, 64, generator=generator).to(DEVICE)
        keys, values = torch.randn(2, kv_heads, capacity, 64, generator=generator).to(DEVICE)
        assert kernels.layout(heads, kv_heads, 64, capacity)[-1] > 1  # several splits
        pos = torch.tensor([position], device=DEVICE)
        out = kernels.decode_attention(q, keys, values, pos, 0.125)
        expected = reference(q, keys, values, position, 0.125, 0, 0.0)
        assert relative_error(out, expected) <= 1e-5
        assert not kernels._split_counters(q.device).any()


@pytest.mark.parametrize(
    "shape", [SHAPES[0], (9, 3, 64, 64, 40, 0, 0.0)], ids=["splits", "one-split"]
)
def test_the_merge_in_a_second_launch_gives_the_same_output(kernels, shape) -> None:
    """The merge kept for comparison (`one_launch=False`: `combine_kernel` after the splits)
    gives what the one launch gives."""
    heads, kv_heads, dim, capacity, position, window, softcap = shape
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(heads, 1, dim, generator=generator).to(DEVICE)
    keys, values = torch.randn(2, kv_heads, capacity, dim, generator=generator).to(DEVICE)
    pos = torch.tensor([position], device=DEVICE)
    outputs = [
        kernels.decode_attention(q, keys, values, pos, dim**-0.5, window, softcap, one_launch)
        for one_launch in (True, False)
    ]
    assert relative_error(outputs[1], outputs[0]) <= 1e-6


def test_rows_past_the_position_are_never_read(kernels) -> None:
    """The rows after the position hold garbage (NaN): masking after a product would spread it."""
    q = torch.randn(9, 1, 64, device=DEVICE)
    keys, values = torch.randn(2, 3, 256, 64, device=DEVICE)
    keys[:, 101:], values[:, 101:] = float("nan"), float("nan")
    out = kernels.decode_attention(q, keys, values, torch.tensor([100], device=DEVICE), 0.125)
    assert torch.isfinite(out).all()
    expected = reference(q, keys[:, :101], values[:, :101], 100, 0.125, 0, 0.0)
    assert relative_error(out, expected) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 4])
def test_engine_with_the_kernel_equals_the_eager_engine(
    kernels, window, smollm2: Model, monkeypatch
) -> None:
    # one layer in the interpreter: every layer's attention is the same launch
    model = model_for_kernels(smollm2, monkeypatch, interpreted_layers=1)
    ffn = DenseFfn(model)
    ids = model.tokenizer.encode(PROMPT + " took it out again and ran")
    static = StandardEngine(window=window, static=True)  # the static step, eagerly
    ours = teacher_forced_logits(static, model, ffn, ids, 6)
    eager = teacher_forced_logits(StandardEngine(window=window), model, ffn, ids, 6)
    assert relative_error(ours, eager) <= 1e-4  # CUDA's SDPA differs from float64 by ~1e-5
    assert "triton attention" in static.info().description


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("spec", ["standard", "standard:compile=1"])
def test_cuda_kernel_path_gives_the_sdpa_path_tokens(spec: str) -> None:
    model = load_model("smollm2-135m", dtype=torch.float32, device="cuda")
    ids = model.tokenizer.encode(PROMPT)
    ffn = DenseFfn(model)
    fast = parse_engine(spec).build(model)
    sdpa = parse_engine("standard:attention=sdpa").build(model)
    fast_tokens = generate(fast, model, ffn, ids, 64, stop_ids=frozenset()).tokens
    sdpa_tokens = generate(sdpa, model, ffn, ids, 64, stop_ids=frozenset()).tokens
    assert fast.dispatch_path() == "cuda-graph"
    assert "triton attention" in fast.info().description
    assert fast_tokens == sdpa_tokens


@pytest.mark.parametrize(
    ("spec_attention", "compile_step", "expected"),
    [
        ("auto", False, "triton"),
        ("auto", True, "triton"),
        ("triton", True, "triton"),
        ("sdpa", False, "sdpa"),
    ],
)
def test_attention_choice(
    spec_attention: str, compile_step: bool, expected: str, smollm2: Model, monkeypatch
) -> None:
    """auto = the Triton kernel wherever Triton runs (6.7 µs against SDPA's 12.2 per layer on
    the H200, docs/PERFORMANCE.md); sdpa keeps torch's attention."""
    monkeypatch.setattr(larql.kernels, "triton_available", lambda device: True)
    model = first_layers(smollm2, 1)  # the choice is made once for every layer
    engine = StandardEngine(static=True, compile=compile_step, attention=spec_attention)
    with torch.inference_mode():
        engine.prefill(model, DenseFfn(model), model.tokenizer.encode(PROMPT))
    assert f"{expected} attention" in engine.info().description


def test_attention_spec_names_what_it_accepts() -> None:
    with pytest.raises(
        MalformedEngineSpec, match="attention=flash must be one of auto, triton, sdpa"
    ):
        parse_engine("standard:attention=flash")


def test_the_op_is_one_opaque_node_for_torch_compile(kernels: ModuleType) -> None:
    """A compiled step keeps the op whole (no graph break) and it returns what the plain
    launcher returns: Inductor calls it rather than launching its kernels itself, which ran
    them 2.2× slower on an H200 (docs/PERFORMANCE.md)."""
    q = torch.randn(9, 1, 64, device=DEVICE)
    keys, values = torch.randn(2, 3, 256, 64, device=DEVICE)
    position = torch.tensor([200], device=DEVICE)

    def step(q: torch.Tensor) -> torch.Tensor:
        return kernels.decode_attention_op(q * 1.0, keys, values, position, 0.125, 0, 0.0)

    explanation = torch._dynamo.explain(step)(q)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    expected = kernels.decode_attention(q, keys, values, position, 0.125)
    assert torch.equal(step(q), expected)
