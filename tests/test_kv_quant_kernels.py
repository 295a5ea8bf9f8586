"""kv-quant's Triton kernels (`larql.kv.kv_quant.kernels`) against its torch codec and a float64
attention over the decoded rows, and the engine on turbo-quant's kernel path against its torch
path.

On a CUDA machine the kernels run compiled; on a CPU machine with Triton installed, in Triton's
interpreter (tests/conftest.py turns it on); without Triton these tests skip."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

import larql.kv.turbo_quant.kernel_path as kernel_path_module
from helpers import (
    greedy_streams,
    kernel_module,
    model_for_kernels,
    relative_error,
    steps_on_shared_state,
)
from larql.inference.decode_path import decode_path
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate
from larql.kv import parse_engine
from larql.kv.captured_step import next_power_of_two
from larql.kv.kv_quant import KvQuantEngine
from larql.kv.kv_quant.codecs import IntCodec
from larql.kv.turbo_quant import planes
from larql.kv.turbo_quant.kernel_path import KernelPath
from larql.kv.turbo_quant.layout import token_vectors
from larql.kv.turbo_quant.store import QuantisedLayer
from larql.models import Model, load_model

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
PROMPT = "Alice put the red ball in the box, and Bob"


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return kernel_module("larql.kv.kv_quant.kernels")


def draw(generator: torch.Generator, *size: int) -> torch.Tensor:
    return torch.randn(*size, generator=generator).to(DEVICE)


def header(codec: IntCodec) -> int:
    return 4 * codec.groups  # float16 scale and zero point per group


def reference_attention(q, k_new, v_new, stored, codec: IntCodec, scale: float) -> torch.Tensor:
    """float64 attention over the torch codec's decoded stored rows, then the exact new row."""
    kv_heads, _, dim = k_new.shape
    keys, values = k_new.double(), v_new.double()
    if stored is not None and stored.shape[0]:
        n = stored.shape[0]
        rows = codec.decode(stored.reshape(-1, codec.bytes_per_vector), torch.float64)
        rows = rows.view(n, 2, kv_heads, dim)
        keys = torch.cat((rows[:, 0].transpose(0, 1), keys), dim=1)  # [Hkv, n + 1, D]
        values = torch.cat((rows[:, 1].transpose(0, 1), values), dim=1)
    group = q.shape[0] // kv_heads
    scores = q.double() @ keys.repeat_interleave(group, 0).transpose(1, 2) * scale
    return torch.softmax(scores, -1) @ values.repeat_interleave(group, 0)


ATTENTION_CASES = [
    (9, 3, 64, 4, 32, False, 70, 96),  # SmolLM2's heads, int4 (even / odd nibbles)
    (4, 2, 64, 8, 32, False, 40, 64),  # int8 (a byte a coordinate)
    (8, 2, 128, 4, 32, False, 45, 64),  # int4, 4 groups of a 128-wide head (factored)
    (4, 1, 256, 4, 32, False, 24, 32),  # int4, 8 groups (factored, a product a group)
    (4, 2, 128, 4, 64, False, 33, 64),  # int4, one group of 64 (factored)
    (4, 1, 64, 2, 16, False, 30, 32),  # int2, 4 groups (each lane picks its group's)
    (4, 2, 48, 4, 32, True, 50, 64),  # rotated: a head of 48 coded at 64
    (4, 2, 64, 4, 8, False, 20, 8),  # a ring (tokens 12..19 in 8 slots), 8 groups (gathered)
    (9, 3, 64, 4, 32, False, 0, 8),  # nothing stored: the new row alone
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "bits", "group", "rotate", "n", "slots"),
    ATTENTION_CASES,
)
def test_attention_over_the_codes_equals_float64_over_the_decoded_rows(
    kernels, heads, kv_heads, dim, bits, group, rotate, n, slots
) -> None:
    """The query at position n attends over the filled slots (the last min(n, slots) tokens,
    decoded as `IntCodec.decode` does) and the exact new row, which it leaves encoded in slot
    n mod slots: `IntCodec.encode`'s bytes (rotated, a code on a rounding boundary may differ)."""
    codec = IntCodec(dim, bits, group, rotate)
    assert kernels.supports(codec)
    generator = torch.Generator().manual_seed(n + dim + bits + group)
    q, k_new, v_new = (draw(generator, h, 1, dim) for h in (heads, kv_heads, kv_heads))
    tokens = range(max(0, n - slots), n)
    row_bytes = 2 * kv_heads * codec.bytes_per_vector
    history = draw(generator, len(tokens) * 2 * kv_heads, dim)
    rows = codec.encode(history).view(len(tokens), row_bytes)
    store = torch.randint(0, 256, (slots, row_bytes), dtype=torch.uint8).to(DEVICE)
    held = torch.tensor([t % slots for t in tokens], dtype=torch.long, device=DEVICE)
    planes.write_rows(store, held, rows, codec.bytes_per_vector, header(codec))
    tables = kernels.CodecTables.of(codec, DEVICE)

    out = kernels.attention(
        q, k_new, v_new, store, torch.tensor([n], device=DEVICE), tables, dim**-0.5
    )

    expected = reference_attention(q, k_new, v_new, rows, codec, dim**-0.5)
    assert out.shape == (heads, 1, dim)
    # float32; 4-bit codes are summed factored (scale·(q·c) + zero·Σq), rounding apart from
    # a product over decoded rows by a few float32 steps
    assert relative_error(out, expected) <= 1e-5
    at = torch.tensor([n % slots], device=DEVICE)
    written = planes.read_rows(store, at, codec.bytes_per_vector, header(codec))
    vectors = written.view(2 * kv_heads, codec.bytes_per_vector)
    reference = codec.encode(token_vectors(k_new, v_new))
    if not rotate:
        assert torch.equal(vectors, reference)
        return
    decoded, expected_rows = (codec.decode(v, torch.float32) for v in (vectors, reference))
    steps = (decoded - expected_rows).abs().max() / (history.abs().max() / (1 << bits))
    assert steps.item() <= 1.5  # at most a code or so apart where the rotation's sums differ


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                not CUDA, reason="Triton's interpreter computes bfloat16 products wrongly"
            ),
        ),
    ],
)
def test_16_bit_products_over_biased_codes_equal_float64(kernels, dtype: torch.dtype) -> None:
    """In 16 bits the 4-bit codes enter the products as code + 128 (bfloat16) or + 1024
    (float16), written into a power of two's mantissa; the bias comes back out of the scores
    and the weights: the attention is float64's over the decoded rows to 16-bit rounding."""
    heads, kv_heads, dim, n, slots = 9, 3, 64, 70, 96
    codec = IntCodec(dim, 4, 32, False)
    generator = torch.Generator().manual_seed(3)
    q, k_new, v_new = (draw(generator, h, 1, dim).to(dtype) for h in (heads, kv_heads, kv_heads))
    history = draw(generator, n * 2 * kv_heads, dim) + 3.0  # zero points far from 0
    rows = codec.encode(history).view(n, 2 * kv_heads * codec.bytes_per_vector)
    store = torch.zeros((slots, rows.shape[1]), dtype=torch.uint8, device=DEVICE)
    held = torch.arange(n, device=DEVICE)
    planes.write_rows(store, held, rows, codec.bytes_per_vector, header(codec))
    tables = kernels.CodecTables.of(codec, DEVICE)
    out = kernels.attention(
        q, k_new, v_new, store, torch.tensor([n], device=DEVICE), tables, dim**-0.5
    )
    expected = reference_attention(q, k_new, v_new, rows, codec, dim**-0.5)
    assert relative_error(out.double(), expected) <= 1e-2


def test_kernels_take_integer_codes_of_power_of_two_widths(kernels) -> None:
    assert kernels.supports(IntCodec(64, 4)) and kernels.supports(IntCodec(48, 8, rotate=True))
    assert kernels.supports(IntCodec(128, 2, group=64))
    assert not kernels.supports(IntCodec(48, 4))  # unrotated, 48 wide
    assert not kernels.supports(IntCodec(64, 4, group=24))  # groups not a power of two
    assert not kernels.supports(IntCodec(64, 4, group=1))


def torch_twin(engine: KvQuantEngine) -> KvQuantEngine:
    """A kv-quant engine on the torch path whose store holds exactly `engine`'s kernel-path
    state: its codes and its exact sink and recent rows."""
    assert engine._fast is not None and engine._layout is not None
    fast, layout = engine._fast, engine._layout
    twin = KvQuantEngine(
        bits=engine.bits,
        group=engine.group,
        rotate=engine.rotate,
        recent=engine.recent,
        sinks=engine.sinks,
        recent_bits=engine.recent_bits,
        attention="sdpa",
    )
    twin._layout, twin._layouts = layout, engine._layouts
    twin._started(engine.position)
    twin._layers = []
    for layer, where in enumerate(fast.layouts):
        sinks, recent = fast.exact_rows(layer)
        store = QuantisedLayer(layout, where.keep, sinks.shape[2], sinks.dtype)
        for rows, part in ((sinks, store.sinks), (recent, store.recent)):
            if len(rows):
                part.append(rows)
        codes = engine.stored_codes(layer)
        if len(codes):
            store.codes.append(codes)
        twin._layers.append(store)
    return twin


LEVERS = {
    "plain": {},
    "rotated, sinks and recent rows": {"rotate": True, "sinks": 2, "recent": 3},
    "int8 ring": {"sinks": 2, "recent": 3, "recent_bits": 8},
}


@pytest.mark.parametrize(
    ("bits", "levers"),
    [
        pytest.param(4, "plain", marks=pytest.mark.long),  # the rotated case runs its steps too
        (4, "rotated, sinks and recent rows"),
        pytest.param(8, "int8 ring", marks=pytest.mark.long),
        pytest.param(2, "plain", marks=pytest.mark.long),
    ],
)
@pytest.mark.slow
def test_engine_on_the_kernels_equals_its_torch_path(
    kernels, bits: int, levers: str, smollm2: Model, monkeypatch
) -> None:
    """From one shared state each step, the kernel path's logits are the torch path's (same
    greedy tokens, float rounding apart), and both store the same bytes: the prompt's codes by
    the torch codec, each step's leaving row by the kernel (but for a code on a rounding
    boundary: the two paths project the new row in different products)."""
    # one layer in the interpreter: every layer's codes go through the same launches
    model = model_for_kernels(smollm2, monkeypatch, interpreted_layers=1)
    ids = model.tokenizer.encode(PROMPT + " took it out again")
    engine = KvQuantEngine(bits=bits, **LEVERS[levers])
    ours, theirs = steps_on_shared_state(model, ids, 8, engine, torch_twin)
    assert isinstance(engine._fast, KernelPath)
    assert "triton kernels" in engine.info().description
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert relative_error(ours, theirs) <= 1e-4
    twin = torch_twin(engine)  # the state after the last step, and the torch path's step
    token = ids[-1]
    ffn = DenseFfn(model)
    with torch.inference_mode():
        twin.decode_step(model, ffn, token)
        engine.decode_step(model, ffn, token)
    assert twin._layers is not None and engine._layout is not None
    codec = engine._layout.k_codec
    assert isinstance(codec, IntCodec)
    for layer in range(model.config.num_layers):
        mine, reference = engine.stored_codes(layer), twin.stored_codes(layer)
        assert mine.shape == reference.shape
        same = (mine == reference).float().mean().item()
        assert same >= (0.98 if codec.rotate else 0.999)  # a code on a rounding boundary
        decoded, expected = (
            codec.decode(c.reshape(-1, codec.bytes_per_vector), torch.float32)
            for c in (mine, reference)
        )
        step = expected.abs().max() * 2 / ((1 << codec.bits) - 1)  # about a code's width
        assert (decoded - expected).abs().max().item() <= 1.5 * step.item()
    assert engine.memory().state == twin.memory().state  # (the slots not yet filled: reserve)


@pytest.mark.slow
def test_spec_picks_the_path_and_says_so(smollm2: Model, monkeypatch) -> None:
    model = model_for_kernels(smollm2, monkeypatch)
    for spec, on_kernels in (
        ("kv-quant", True),
        ("kv-quant:bits=8,rotate=1,recent=4,sinks=2", True),
        ("kv-quant:attention=sdpa", False),
        ("kv-quant:format=fp8", False),
        ("kv-quant:group=24", False),
    ):
        engine = parse_engine(spec).build(model)
        with torch.inference_mode():
            engine.prefill(model, DenseFfn(model), model.tokenizer.encode(PROMPT))
        assert isinstance(engine, KvQuantEngine)
        assert isinstance(engine._fast, KernelPath) == on_kernels, spec
        description = engine.info().description
        assert ("triton kernels" in description) == on_kernels, description
        if not on_kernels and "sdpa" not in spec:
            assert "torch path: the Triton kernels take" in description


@pytest.mark.slow
def test_kernel_path_sessions_batched_give_their_tokens_alone(
    kernels, smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three sessions of three lengths (stores that grow at different steps, rings that wrap)
    decoded in one batched step (turbo-quant's `BatchedKernelStep` over these launches) get
    the tokens and logits they get alone."""
    model = model_for_kernels(smollm2, monkeypatch, interpreted_layers=1)
    monkeypatch.setattr(kernel_path_module, "initial_capacity", lambda n: next_power_of_two(n + 1))
    prompts = ["The capital of France is", PROMPT, "One two"]
    levers = {"bits": 4, "recent": 3, "sinks": 2}
    alone = [KvQuantEngine(**levers) for _ in prompts]
    alone_tokens, alone_logits = greedy_streams(model, alone, prompts, 4, batched=False)
    engines = [KvQuantEngine(**levers) for _ in prompts]
    tokens, logits = greedy_streams(model, engines, prompts, 4, batched=True)
    assert all(isinstance(e._fast, KernelPath) for e in engines)
    assert tokens == alone_tokens
    assert torch.allclose(logits, alone_logits, atol=1e-3, rtol=0)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_graph_step_on_the_codes_in_bfloat16() -> None:
    """SmolLM2 in bfloat16 on CUDA with kv-quant:bits=4: the captured step replays the eager
    kernel step's launches (the same 64 greedy tokens); the decode path reported is the CUDA
    graph (the torch path's is not); from one shared state each step, the kernel path's logits
    are the torch path's to bfloat16 rounding."""
    model = load_model("smollm2-135m", dtype=torch.bfloat16, device="cuda")
    ids = model.tokenizer.encode(PROMPT)
    ffn = DenseFfn(model)
    specs = ("kv-quant:bits=4", "kv-quant:bits=4,graph=0", "kv-quant:bits=4,attention=sdpa")
    engines = [parse_engine(spec).build(model) for spec in specs]
    runs = [generate(e, model, ffn, ids, 64, stop_ids=frozenset()) for e in engines]
    assert [e.dispatch_path() for e in engines] == ["cuda-graph", "static", None]
    assert runs[0].tokens == runs[1].tokens
    paths = [decode_path(model, run.decode_kinds, 63) for run in runs]
    assert paths[0].endswith("CUDA graph + Triton kernels"), paths
    assert "CUDA graph" not in paths[1] and "CUDA graph" not in paths[2], paths
    assert "triton kernels, cuda-graph step" in engines[0].info().description
    assert "decoded attention" in engines[2].info().description
    long_ids = model.tokenizer.encode(PROMPT + " took it out again and gave it to Carol")
    ours, theirs = steps_on_shared_state(model, long_ids, 8, KvQuantEngine(bits=4), torch_twin)
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item() >= 0.9
    assert relative_error(ours.float(), theirs.float()) <= 5e-2
