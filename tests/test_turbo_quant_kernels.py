"""turbo-quant's Triton kernels (`larql.kv.turbo_quant.kernels`) against the torch codec and a
float64 attention over the decoded rows, and the engine that uses them against its torch path.

On a CUDA machine the kernels run compiled; on a CPU machine with Triton installed, in Triton's
interpreter (tests/conftest.py turns it on); without Triton these tests skip."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

import larql.kernels
from helpers import kernel_module, model_for_kernels, relative_error, steps_on_shared_state
from larql.inference.engine import KvEngine
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate
from larql.kv import captured_step, parse_engine
from larql.kv.turbo_quant import TurboQuantEngine, planes
from larql.kv.turbo_quant.codec import TurboQuantCodec, split_norms
from larql.kv.turbo_quant.kernel_path import KernelPath
from larql.kv.turbo_quant.layout import ring_slots, token_vectors
from larql.kv.turbo_quant.recent import int8_decode, int8_encode
from larql.kv.turbo_quant.store import QuantisedLayer
from larql.models import Model, load_model
from tiny_models import build_tiny_model, random_ids

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

if CUDA:  # a kernel around the 4-bit decoding (`test_centroid_lookup_decodes_…`)
    import triton
    import triton.language as tl

    from larql.kv.turbo_quant.kernels import _nibble_centroids

    @triton.jit
    def _decode_nibbles(codes, even_ptr, odd_ptr, centroids, LOOKUP: tl.constexpr):
        rows, lanes = tl.arange(0, 128), tl.arange(0, 32)
        table = tl.load(centroids + tl.arange(0, 16)[None, :] + tl.zeros([128, 1], tl.int32))
        even, odd = _nibble_centroids(
            codes, rows * 36, rows < 100, lanes, table, even_ptr.dtype.element_ty, LOOKUP
        )
        tl.store(even_ptr + rows[:, None] * 32 + lanes[None, :], even)
        tl.store(odd_ptr + rows[:, None] * 32 + lanes[None, :], odd)


PROMPT = "Alice put the red ball in the box, and Bob"


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return kernel_module("larql.kv.turbo_quant.kernels")


def draw(generator: torch.Generator, *size: int) -> torch.Tensor:
    return torch.randn(*size, generator=generator).to(DEVICE)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dim", [64, 48, 128])
def test_encode_writes_the_codec_bytes(kernels, bits: int, dim: int) -> None:
    codec = TurboQuantCodec(dim, bits)
    # one program per vector (Triton's interpreter runs each in turn): 32 vectors of 64 or more
    # coordinates reach every cell of every width
    x = draw(torch.Generator().manual_seed(bits * dim), 32, dim)
    got = kernels.encode(x, kernels.CodecTables.of(codec, DEVICE))
    assert got.shape == (32, codec.bytes_per_vector) and got.dtype == torch.uint8
    assert_codec_bytes(codec, got, x)


def reference_attention(q, k_new, v_new, stored, codec, scale: float, softcap: float):
    """float64 attention over the decoded stored rows followed by the exact new row."""
    kv_heads, _, dim = k_new.shape
    n = 0 if stored is None else stored.shape[0]
    keys, values = k_new.double(), v_new.double()
    if n:
        rows = codec.decode(stored.reshape(-1, codec.bytes_per_vector), torch.float64)
        rows = rows.view(n, 2, kv_heads, dim)
        keys = torch.cat((rows[:, 0].transpose(0, 1), keys), dim=1)  # [Hkv, n + 1, D]
        values = torch.cat((rows[:, 1].transpose(0, 1), values), dim=1)
    group = q.shape[0] // kv_heads
    scores = q.double() @ keys.repeat_interleave(group, 0).transpose(1, 2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.softmax(scores, -1) @ values.repeat_interleave(group, 0)


def slots_holding(
    codec, kv_heads: int, history: torch.Tensor, tokens: range, slots: int
) -> torch.Tensor:
    """A store of `slots` slots with the encoded `history` [len(tokens)·2·Hkv, D] of `tokens`,
    token t in slot t mod slots, laid out by plane (the other slots hold noise nobody may read)."""
    row_bytes = 2 * kv_heads * codec.bytes_per_vector
    rows = codec.encode(history).view(len(tokens), row_bytes)
    store = torch.randint(0, 256, (slots, row_bytes), dtype=torch.uint8)
    store = store.to(DEVICE)
    held = torch.tensor([t % slots for t in tokens], dtype=torch.long, device=DEVICE)
    planes.write_rows(store, held, rows.to(DEVICE), codec.bytes_per_vector)
    return store


def rows_in(store: torch.Tensor, codec, slots: list[int]) -> torch.Tensor:
    """The tokens in `store`'s `slots`, in the codec's row format: uint8 [n, row_bytes]."""
    at = torch.tensor(slots, dtype=torch.long, device=store.device)
    return planes.read_rows(store, at, codec.bytes_per_vector)


ATTENTION_CASES = [
    (9, 3, 64, 4, 70, 96, 0.0),  # SmolLM2's heads
    (9, 3, 64, 2, 1, 4, 0.0),  # one stored row
    (4, 2, 64, 2, 50, 64, 0.0),  # 2 bits: four coordinates a byte, loaded once
    (9, 3, 64, 3, 0, 8, 0.0),  # none: the new row alone
    (4, 1, 48, 3, 600, 1024, 0.0),  # padded head width, 3 bits (one byte per coordinate)
    (4, 1, 48, 4, 600, 1024, 0.0),  # padded head width, 4 bits (even / odd nibbles)
    (4, 2, 16, 4, 40, 64, 0.0),  # 4 bits too narrow to split in nibbles
    (4, 1, 64, 4, 3000, 8192, 0.0),  # a deep store: several blocks per split
    (4, 2, 64, 4, 90, 128, 30.0),  # soft-capped scores (Gemma 2)
    (4, 2, 64, 4, 20, 8, 0.0),  # a ring (sliding layer): tokens 12..19 in 8 slots
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "bits", "n", "slots", "softcap"),
    ATTENTION_CASES,
)
def test_attention_equals_float64_over_the_stored_rows_and_stores_the_new_one(
    kernels, heads, kv_heads, dim, bits, n, slots, softcap
) -> None:
    """The query at position n attends over the filled slots (the last min(n, slots) tokens)
    and the exact new row, which it leaves encoded in slot n mod slots."""
    codec = TurboQuantCodec(dim, bits)
    generator = torch.Generator().manual_seed(n + dim + bits)
    q, k_new, v_new = (draw(generator, h, 1, dim) for h in (heads, kv_heads, kv_heads))
    tokens = range(max(0, n - slots), n)
    history = draw(generator, len(tokens) * 2 * kv_heads, dim)  # [K heads, V heads] per token
    store = slots_holding(codec, kv_heads, history, tokens, slots)
    stored = rows_in(store, codec, [t % slots for t in tokens])
    position = torch.tensor([n], device=DEVICE)
    tables = kernels.CodecTables.of(codec, DEVICE)

    out = kernels.attention(q, k_new, v_new, store, position, tables, dim**-0.5, softcap)

    expected = reference_attention(
        q, k_new, v_new, stored if len(tokens) else None, codec, dim**-0.5, softcap
    )
    assert out.shape == (heads, 1, dim)
    assert relative_error(out, expected) <= 2e-6
    written = rows_in(store, codec, [n % slots])[0].view(2 * kv_heads, -1)
    assert_codec_bytes(codec, written, token_vectors(k_new, v_new))


def assert_codec_bytes(codec, encoded: torch.Tensor, vectors: torch.Tensor) -> None:
    """Same indices as `TurboQuantCodec.encode`; the float32 norm may differ in its last bit
    (the kernel sums the squares in another order)."""
    expected = codec.encode(vectors)
    (norms, payload), (ref_norms, ref_payload) = split_norms(encoded), split_norms(expected)
    assert torch.equal(codec.decode_indices(payload), codec.decode_indices(ref_payload))
    assert relative_error(norms, ref_norms) <= 3e-7


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_int8_ring_rows_are_the_torch_codecs_bytes(kernels, n: int) -> None:
    """With the recent rows at int8 (2 sinks, a ring of 3), the step at position n attends
    over the sinks, the ring's decoded rows and the new row, moves the row leaving the ring
    into the codes from its int8 copy, and writes the new row into the ring (or the sinks)
    as `recent.int8_encode` does: the same codes and scales, byte for byte."""
    heads, kv_heads, dim, sinks, recent = 8, 2, 64, 2, 3
    codec = TurboQuantCodec(dim, 3, norm_correction=True)
    tables = kernels.CodecTables.of(codec, DEVICE)
    generator = torch.Generator().manual_seed(n)
    q, k_new, v_new = (draw(generator, h, 1, dim) for h in (heads, kv_heads, kv_heads))
    rows = draw(generator, n, 2, kv_heads, dim) * 3  # tokens 0 … n−1 as they were stored
    codes, scales = int8_encode(rows)
    levers = kernels.Levers(
        exact=torch.zeros((sinks, 2, kv_heads, dim), dtype=torch.float16, device=DEVICE),
        mean=torch.zeros((2, kv_heads, dim), device=DEVICE),
        mean_rotated=torch.zeros((2, kv_heads, dim), device=DEVICE),
        sinks=sinks,
        recent=recent,
        ring=torch.zeros((ring_slots(recent), 2, kv_heads, dim), dtype=torch.int8, device=DEVICE),
        ring_scales=torch.zeros(
            (ring_slots(recent), 2, kv_heads), dtype=torch.float16, device=DEVICE
        ),
    )
    held = [rows[t] if t < sinks else int8_decode(codes[t], scales[t]) for t in range(n)]
    for t in range(n):
        if t < sinks:
            levers.exact[t] = rows[t].half()
            held[t] = rows[t].half().float()
        elif t >= n - recent:
            slot = t % ring_slots(recent)
            levers.ring[slot], levers.ring_scales[slot] = codes[t], scales[t, ..., 0]
    coded = [t for t in range(sinks, n - recent)]  # rows already in the codes
    store = torch.zeros((16, 2 * kv_heads * codec.bytes_per_vector), dtype=torch.uint8)
    store = store.to(DEVICE)
    for t in coded:
        row = codec.encode(token_vectors(*held[t].unsqueeze(2).unbind(0))).view(1, -1)
        planes.write_rows(
            store, torch.tensor([t], device=DEVICE), row.to(DEVICE), codec.bytes_per_vector
        )

    out = kernels.attention(
        q,
        k_new,
        v_new,
        store,
        torch.tensor([n], device=DEVICE),
        tables,
        dim**-0.5,
        0.0,
        levers=levers,
    )

    decoded = [
        codec.decode(rows_in(store, codec, [t]).view(2 * kv_heads, -1), torch.float32).view(
            2, kv_heads, dim
        )
        if t in coded
        else held[t]
        for t in range(n)
    ]
    history = torch.stack(decoded) if decoded else torch.zeros((0, 2, kv_heads, dim))
    keys = torch.cat((history[:, 0].transpose(0, 1), k_new.float()), dim=1).double()
    values = torch.cat((history[:, 1].transpose(0, 1), v_new.float()), dim=1).double()
    group = heads // kv_heads
    scores = q.double() @ keys.repeat_interleave(group, 0).transpose(1, 2) * dim**-0.5
    expected = torch.softmax(scores, -1) @ values.repeat_interleave(group, 0)
    assert relative_error(out, expected) <= 2e-6
    new_codes, new_scales = int8_encode(torch.stack((k_new, v_new)).squeeze(2))  # [2, Hkv, …]
    if n >= sinks:
        assert torch.equal(levers.ring[n % ring_slots(recent)], new_codes)
        assert torch.equal(levers.ring_scales[n % ring_slots(recent)], new_scales[..., 0])
    else:
        assert torch.equal(levers.exact[n], torch.stack((k_new, v_new)).squeeze(2).half())
    leaving = n - recent
    if leaving >= sinks:  # encoded from its int8 copy
        assert_codec_bytes(
            codec,
            rows_in(store, codec, [leaving]).view(2 * kv_heads, -1),
            token_vectors(*held[leaving].unsqueeze(2).unbind(0)),
        )


def test_workspace_is_reused_across_calls(kernels) -> None:
    """The engine hands every layer the same workspace: a call leaves nothing the next reads."""
    codec = TurboQuantCodec(64, 4)
    tables = kernels.CodecTables.of(codec, DEVICE)
    workspace = kernels.Workspace.of(9, 3, tables, DEVICE)
    generator = torch.Generator().manual_seed(3)
    outs = []
    for n in (50, 3):
        q, k_new, v_new = (
            draw(generator, 9, 1, 64),
            draw(generator, 3, 1, 64),
            draw(generator, 3, 1, 64),
        )
        store = slots_holding(codec, 3, draw(generator, n * 6, 64), range(n), 64)
        position = torch.tensor([n], device=DEVICE)
        shared = kernels.attention(
            q, k_new, v_new, store.clone(), position, tables, 0.125, 0.0, workspace
        )
        fresh = kernels.attention(q, k_new, v_new, store.clone(), position, tables, 0.125, 0.0)
        outs.append(torch.equal(shared, fresh))
    assert outs == [True, True]


def torch_path_holding_the_state_of(engine: KvEngine) -> KvEngine:
    """A turbo-quant engine on the torch path whose store holds exactly `engine`'s state: its
    codes, its exact sink and recent rows, its centering rows."""
    assert isinstance(engine, TurboQuantEngine) and engine._fast is not None
    fast, layout = engine._fast, engine._layout
    assert layout is not None
    twin = TurboQuantEngine(
        bits=engine.bits,
        attention="sdpa",
        recent=engine.recent,
        sinks=engine.sinks,
        norm_correction=engine.norm_correction,
        center=engine.center,
        recent_bits=engine.recent_bits,
    )
    twin._layout, twin._layouts = layout, engine._layouts
    twin._started(engine.position)  # a prefilled engine at the leader's position
    twin._layers = []
    for layer, where in enumerate(fast.layouts):
        sinks, recent = fast.exact_rows(layer)
        kv_heads = sinks.shape[2]
        store = QuantisedLayer(layout, where.keep, kv_heads, sinks.dtype)
        for rows, part in ((sinks, store.sinks), (recent, store.recent)):
            if len(rows):
                part.append(rows)
        codes = engine.stored_codes(layer)
        if len(codes):
            store.codes.append(codes)
        store.mean = fast.mean(layer)
        twin._layers.append(store)
    return twin


def kernel_steps_vs_torch_steps(model: Model, ids: list[int], prompt_len: int, bits: int, **levers):
    """Each decode step of the engine on the kernels, and the torch path's step from the very
    state the kernel engine holds → (kernel engine, relative error of the step logits)."""
    fused = TurboQuantEngine(bits=bits, **levers)
    ours, reference = steps_on_shared_state(
        model, ids, prompt_len, fused, torch_path_holding_the_state_of
    )
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    return fused, relative_error(ours, reference)


LEVERS = {  # the catalog's levers, with rings small enough to wrap in a few steps
    "plain": {},
    "catalog": {"recent": 3, "sinks": 2, "norm_correction": True, "center": True},
    "ring of one": {"recent": 1, "center": True},
    "sinks only": {"sinks": 9, "norm_correction": True},  # the prompt fills 8, a step the 9th
    "int8 ring": {
        "recent": 3,
        "sinks": 2,
        "norm_correction": True,
        "center": True,
        "recent_bits": 8,
    },
}


@pytest.mark.parametrize(
    ("bits", "levers"),
    [
        # 2 bits without levers: the sinks-only case runs the same 2-bit launches, and the
        # float64 checks above run every width without levers
        pytest.param(2, "plain", marks=pytest.mark.long),
        # the 4-bit byte split without levers: the catalog case below runs the same launch
        pytest.param(4, "plain", marks=pytest.mark.long),
        (4, "catalog"),
        # a ring of one recent row (the 3-bit launches also run in the int8-ring case)
        pytest.param(3, "ring of one", marks=pytest.mark.long),
        (2, "sinks only"),
        (3, "int8 ring"),
    ],
)
@pytest.mark.slow
def test_engine_with_the_kernels_equals_its_torch_path(
    kernels, bits: int, levers: str, smollm2: Model, monkeypatch
) -> None:
    model = model_for_kernels(smollm2, monkeypatch)
    # 8 prompt tokens and 5 steps: the catalog's ring of 3 recent rows (4 slots) wraps, the
    # sinks-only case fills its 9th sink and then codes
    ids = model.tokenizer.encode(PROMPT + " took it out again")[:13]
    fused, error = kernel_steps_vs_torch_steps(model, ids, 8, bits, **LEVERS[levers])
    assert "triton kernels" in fused.info().description
    assert error <= 1e-4  # CUDA's float32 matmuls differ from float64 by ~1e-5


@pytest.mark.slow
def test_kernel_levers_store_the_torch_paths_bytes(kernels, smollm2: Model, monkeypatch) -> None:
    """With the catalog's levers, each step moves the oldest recent row into the codes: from the
    same state, the kernels and the torch path store the same codes (indices exact but for a
    value on a cell boundary, norms to float32 rounding), the same sinks and the same recent
    rows (the new row to 16-bit rounding of the tiny difference in its projection)."""
    model = model_for_kernels(smollm2, monkeypatch)
    ids = model.tokenizer.encode(PROMPT + " took it out again")
    fused = TurboQuantEngine(bits=4, **LEVERS["catalog"])
    codec = TurboQuantCodec(model.config.head_dim, 4, norm_correction=True)
    ffn = DenseFfn(model)
    with torch.inference_mode():
        fused.prefill(model, ffn, ids[:6])
        for token in ids[6:11]:  # 5 steps: each moves a recent row into the codes
            twin = torch_path_holding_the_state_of(fused)
            twin.decode_step(model, ffn, token)
            fused.decode_step(model, ffn, token)
            assert fused._fast is not None and twin._layers is not None
            for layer in range(model.config.num_layers):
                ours, theirs = fused.stored_codes(layer), twin.stored_codes(layer)
                assert ours.shape == theirs.shape == (fused.position - 2 - 3, ours.shape[1])
                (norms, payload), (ref_norms, ref_payload) = (
                    split_norms(c.reshape(-1, codec.bytes_per_vector)) for c in (ours, theirs)
                )
                flips = codec.decode_indices(payload) != codec.decode_indices(ref_payload)
                assert flips.float().mean().item() <= 1e-3
                assert relative_error(norms, ref_norms) <= 1e-5
                sinks, recent = fused._fast.exact_rows(layer)
                store = twin._layers[layer]
                assert torch.equal(sinks, store.sinks.rows)
                torch.testing.assert_close(recent, store.recent.rows, rtol=2e-3, atol=2e-3)
                assert torch.equal(fused._fast.mean(layer), store.mean)


@pytest.mark.parametrize(
    "levers",
    [
        # long: test_encode_writes_the_codec_bytes checks the plain encode launch; the catalog
        # case runs the engine's prefill through it (and the levers' rows around it)
        pytest.param("plain", marks=pytest.mark.long),
        "catalog",
    ],
)
@pytest.mark.slow
def test_the_prompt_is_stored_as_the_codec_stores_it(
    kernels, levers: str, smollm2: Model, monkeypatch
) -> None:
    """The kernel encoding of the prompt's exact K/V and the codec's, byte for byte (norms to
    float32 rounding), on every layer; with the levers, the rows between the 2 sinks and the
    3 newest, centered."""
    model = model_for_kernels(smollm2, monkeypatch)
    ids = model.tokenizer.encode(PROMPT)
    lever = LEVERS[levers]
    engines = [
        TurboQuantEngine(bits=4, **lever),
        TurboQuantEngine(bits=4, attention="sdpa", **lever),
    ]
    with torch.inference_mode():
        for engine in engines:
            engine.prefill(model, DenseFfn(model), ids)
    codec = TurboQuantCodec(model.config.head_dim, 4, norm_correction=bool(lever))
    coded = len(ids) - lever.get("sinks", 0) - lever.get("recent", 0)
    for layer in range(model.config.num_layers):
        fused, reference = (e.stored_codes(layer) for e in engines)
        assert fused.shape == reference.shape == (coded, engines[1].stored_codes(0).shape[1])
        (norms, payload), (ref_norms, ref_payload) = (
            split_norms(c.reshape(-1, codec.bytes_per_vector)) for c in (fused, reference)
        )
        flips = (codec.decode_indices(payload) != codec.decode_indices(ref_payload)).float()
        assert flips.mean().item() <= 1e-3  # a value on a cell boundary may round either way
        assert relative_error(norms, ref_norms) <= 1e-5


@pytest.fixture(scope="module")
def tiny_sliding(request, tmp_path_factory: pytest.TempPathFactory) -> Model:
    """float32 tiny models with sliding layers (6 keys; gemma2 also soft-caps its scores) and
    a head width the codec pads (12 → 16)."""
    pytest.importorskip("transformers")
    directory: Path = tmp_path_factory.mktemp(f"tq-kernels-{request.param}")
    build_tiny_model(request.param, directory)
    return load_model(str(directory), dtype=torch.float32, device=DEVICE)


@pytest.mark.parametrize(
    ("tiny_sliding", "min_capacity", "headroom", "prompt", "levers"),
    [
        # capacity 4 < the 5 a sliding layer keeps: 4 → 5 first (the catalog case below too)
        pytest.param("gemma3", 4, 0, 3, "plain", marks=pytest.mark.long),
        ("gemma2", 8, 2, 5, "plain"),  # capacity 8 → 16; sliding rings of 5 from the start
        ("gemma3", 4, 0, 3, "catalog"),  # sliding layers: no sinks, 3 recent rows, 2 coded
    ],
    indirect=["tiny_sliding"],
)
@pytest.mark.slow
def test_kernel_path_rings_sliding_layers_and_grows_full_ones(
    kernels,
    tiny_sliding: Model,
    monkeypatch,
    min_capacity: int,
    headroom: int,
    prompt: int,
    levers: str,
) -> None:
    """Sliding layers keep their window − 1 rows in a ring of slots; full layers' slots double
    when the position reaches the capacity (made small here so 10 tokens grow it once or twice).
    Same logits as the torch path; the memory is the slots. On CUDA the step is a captured
    graph, captured again at each growth (its warm-up must not leave the ring's oldest row
    overwritten)."""
    model = tiny_sliding
    if not CUDA:
        monkeypatch.setattr(larql.kernels, "triton_available", lambda device: True)
    monkeypatch.setattr(captured_step, "MIN_CAPACITY", min_capacity)
    monkeypatch.setattr(captured_step, "DECODE_HEADROOM", headroom)
    ids = random_ids(10, seed=4)
    fused, error = kernel_steps_vs_torch_steps(model, ids, prompt, 4, **LEVERS[levers])
    assert "triton kernels" in fused.info().description
    assert fused.dispatch_path() == ("cuda-graph" if CUDA else "static")
    assert error <= 1e-4
    cfg = model.config
    if levers != "plain":
        for layer, spec in enumerate(cfg.layers):
            kept = len(ids) if spec.sliding_window is None else spec.sliding_window - 1
            assert fused.stored_rows(layer) == kept
        return
    row_bytes = 2 * cfg.num_kv_heads * TurboQuantCodec(cfg.head_dim, 4).bytes_per_vector
    slots = kept_rows = 0
    for layer, spec in enumerate(cfg.layers):
        kept = len(ids) if spec.sliding_window is None else spec.sliding_window - 1
        assert fused.stored_rows(layer) == fused.stored_codes(layer).shape[0] == kept
        kept_rows += kept
        slots += 16 if spec.sliding_window is None else kept
    assert fused.memory().state == kept_rows * row_bytes
    assert fused.memory().total == slots * row_bytes  # full layers end at 16 slots


@pytest.mark.slow
def test_spec_picks_the_path(smollm2: Model, monkeypatch) -> None:
    model = model_for_kernels(smollm2, monkeypatch)
    for spec, on_kernels in (
        ("turbo-quant", True),  # the catalog's levers included
        ("turbo-quant:recent=0,sinks=0,norm=0,center=0", True),
        ("turbo-quant:attention=sdpa", False),
        ("turbo-quant:k_bits=4,v_bits=2", False),  # one codec for K and V only
        ("kv-quant", True),  # its integer codes: the same path, its own launches
        ("kv-quant:format=fp8", False),
    ):
        engine = parse_engine(spec).build(model)
        assert isinstance(engine, TurboQuantEngine)
        with torch.inference_mode():  # the path is picked at prefill: a short prompt shows it
            engine.prefill(model, DenseFfn(model), model.tokenizer.encode(PROMPT)[:4])
        assert isinstance(engine._fast, KernelPath) == on_kernels, spec
        assert ("triton kernels" in engine.info().description) == on_kernels
    assert parse_engine("turbo-quant:graph=0").build(model).use_graph is False


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_step_gives_the_eager_kernel_tokens(dtype: torch.dtype) -> None:
    """The captured step replays the same launches the eager step makes: the same 64 greedy
    tokens, and the same bytes stored."""
    model = load_model("smollm2-135m", dtype=dtype, device="cuda")
    ids = model.tokenizer.encode(PROMPT)
    ffn = DenseFfn(model)
    engines = [parse_engine(spec).build(model) for spec in ("turbo-quant", "turbo-quant:graph=0")]
    runs = [generate(e, model, ffn, ids, 64, stop_ids=frozenset()) for e in engines]
    assert engines[0].dispatch_path() == "cuda-graph"
    assert engines[1].dispatch_path() == "static"
    assert runs[0].tokens == runs[1].tokens


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (the interpreter runs no PTX)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("levers", [False, True])
def test_centroid_lookup_in_ptx_gives_the_gathers_attention(
    kernels, dtype: torch.dtype, levers: bool
) -> None:
    """A 16-bit model's 4-bit partial launch decodes the codes with `centroid_lookup`'s PTX;
    with the lookups taken away it gathers them. The decoded values are the same, so the
    splits' float32 state agrees to summation order (a wrong centroid moves it by ~1e-1) and
    the outputs to their 16-bit rounding, over a deep store with sinks, recent rows and
    centering or with none."""
    from dataclasses import replace

    heads, kv_heads, dim, n, slots = 32, 8, 64, 5000, 8192
    codec = TurboQuantCodec(dim, 4)
    generator = torch.Generator().manual_seed(dim + n)
    q, k_new, v_new = (draw(generator, h, 1, dim).to(dtype) for h in (heads, kv_heads, kv_heads))
    history = draw(generator, n * 2 * kv_heads, dim)
    tables = kernels.CodecTables.of(codec, DEVICE)
    assert dtype in tables.lookups
    states, outputs = [], []
    for run_tables in (tables, replace(tables, lookups={})):
        store = slots_holding(codec, kv_heads, history, range(n), slots)
        lever_set = None
        if levers:
            exact = draw(generator.manual_seed(1), 4 + ring_slots(32), 2, kv_heads, dim).to(dtype)
            mean = draw(generator.manual_seed(2), 2, kv_heads, dim)
            lever_set = kernels.Levers(
                exact=exact.contiguous(),
                mean=mean,
                mean_rotated=(mean @ tables.rotation).contiguous(),
                sinks=4,
                recent=32,
                center=True,
            )
        workspace = kernels.Workspace.of(heads, kv_heads, tables, DEVICE)
        position = torch.tensor([n], device=DEVICE)
        outputs.append(
            kernels.attention(
                q, k_new, v_new, store, position, run_tables, dim**-0.5, 0.0, workspace, lever_set
            )
        )
        splits = kernels.splits(slots)  # the launch's states: [Hkv, splits + 1, GP(, D')] in front
        used, group = splits * n // slots, heads // kv_heads  # full splits, real query rows
        states_per_head = kernels.state_slots(splits)
        l_sum = workspace.l_sum.flatten()[: workspace.l_sum[:, :states_per_head].numel()]
        l_sum = l_sum.view(kv_heads, states_per_head, -1)[:, :used, :group]
        acc = workspace.acc.flatten()[: workspace.acc[:, :states_per_head].numel()]
        acc = acc.view(kv_heads, states_per_head, -1, dim)[:, :used, :group]
        states.append(torch.cat([acc.flatten(), l_sum.flatten()]))
    assert relative_error(states[0], states[1]) <= 1e-4  # measured 2e-5
    assert relative_error(outputs[0], outputs[1]) <= 4e-3


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (the interpreter runs no PTX)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_centroid_lookup_decodes_the_gathers_values_exactly(kernels, dtype: torch.dtype) -> None:
    """`_nibble_centroids` over random packed bytes: the PTX lookup and the gather give the same
    16-bit values, bit for bit."""
    tables = kernels.CodecTables.of(TurboQuantCodec(64, 4), DEVICE)
    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (128 * 36,), dtype=torch.uint8, generator=generator).to(DEVICE)
    decoded = []
    for lookup in (tables.lookups[dtype], ""):
        even = torch.empty((128, 32), dtype=dtype, device=DEVICE)
        odd = torch.empty_like(even)
        _decode_nibbles[(1,)](codes, even, odd, tables.centroids, LOOKUP=lookup)
        decoded.append(torch.cat((even, odd)))
    assert torch.equal(decoded[0], decoded[1])
