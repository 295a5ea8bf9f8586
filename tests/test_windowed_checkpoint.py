"""`windowed-checkpoint`: tumbling windows seeded by a one-row K/V checkpoint.

The oracle is the definition written as one stateless forward pass with a static mask: query i
(window w = i // W) sees key j iff j is in window w and j ≤ i, or w ≥ 1 and j = w·W − 1 (the
checkpoint row). Every key's K/V is a function of its own hidden, which the same mask produced,
so the engine must equal this pass to rounding — exact vs `standard` inside the first window,
different after it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import first_layers, full_forward_logits, relative_error, teacher_forced
from larql.inference.errors import InvariantViolation
from larql.inference.ffn import DenseFfn
from larql.inference.layer import (
    effective_window,
    embed,
    ffn_block,
    final_logits,
    project_qkv,
    rms_norm,
    token_tensor,
)
from larql.kv import parse_engine
from larql.kv.spec import EngineBuildError, MalformedEngineSpec
from larql.kv.windowed_checkpoint import WindowedCheckpointEngine
from larql.models import Model
from tiny_models import random_ids

TEXT = (
    "Alice put the red ball in the box, and Bob took it out again and ran away to the park "
    "where the other children were playing football in the afternoon sun"
)


def tumbling_mask(n: int, window: int, arch_window: int | None) -> torch.Tensor:
    pos = torch.arange(n)
    win = pos // window
    q, k = pos[:, None], pos[None, :]
    same_window = (win[:, None] == win[None, :]) & (k <= q)
    checkpoint = (win[:, None] >= 1) & (k == win[:, None] * window - 1)
    mask = same_window | checkpoint  # [S, S]
    if arch_window is not None:
        mask &= (q - k) < arch_window
    return mask


def tumbling_oracle_logits(model: Model, ids: list[int], window: int) -> torch.Tensor:
    """Logits [S, V] of the windowed-checkpoint definition as one masked forward pass."""
    cfg = model.config
    assert cfg.arch.attn_softcap is None  # the oracle's attention is plain SDPA
    ffn = DenseFfn(model)
    n = len(ids)
    with torch.inference_mode():
        h = embed(model, token_tensor(model, ids))  # [S, H]
        for layer in range(cfg.num_layers):
            lw = model.weights.layers[layer]
            mask = tumbling_mask(n, window, effective_window(model, layer, None))
            q, k, v = project_qkv(model, layer, h, 0)
            attn = F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=mask, scale=cfg.attn_scale, enable_gqa=True
            )[0]  # [Hq, S, D]
            out = F.linear(attn.transpose(0, 1).reshape(n, cfg.q_dim), lw.wo, lw.bo)
            if lw.post_attn_norm is not None:
                out = rms_norm(out, lw.post_attn_norm, cfg.norm_eps)
            h = ffn_block(model, layer, h + out, ffn)
        return final_logits(model, h)


def run(engine, model: Model, ids: list[int], prompt_len: int) -> list[torch.Tensor]:
    ffn = DenseFfn(model)
    with torch.inference_mode():
        hidden = [engine.prefill(model, ffn, ids[:prompt_len])]
        hidden += [engine.decode_step(model, ffn, t) for t in ids[prompt_len:]]
    return hidden


# ---------------------------------------------------------------------------- spec


def test_spec_names_defaults_and_validation() -> None:
    for name in ("windowed-checkpoint", "unlimited-context", "unlimited", "unlimited_context"):
        kind = parse_engine(name)
        assert kind.display_name == "windowed-checkpoint"
        assert kind.params["window"] == 512
    assert parse_engine("windowed_checkpoint:window=7").params["window"] == 7
    for bad in ("windowed-checkpoint:window=0", "unlimited:window=-3", "unlimited:window=abc"):
        with pytest.raises(MalformedEngineSpec, match="window"):
            parse_engine(bad)
    with pytest.raises(EngineBuildError):
        WindowedCheckpointEngine(window=0)


@pytest.fixture(scope="module")
def model(smollm2: Model) -> Model:
    """The real model's first two layers: the windows, checkpoints and archive work layer by
    layer alike, and the oracle is computed on the same layers."""
    return first_layers(smollm2, 2)


@pytest.fixture(scope="module")
def model_f64(model: Model) -> Model:
    return model.to(dtype=torch.float64)


# ---------------------------------------------------------------------------- contract


def test_exact_inside_the_first_window_in_float64(model_f64: Model) -> None:
    ids = model_f64.tokenizer.encode(TEXT)[:12]
    ours = teacher_forced(model_f64, "windowed-checkpoint:window=12", ids, 8)
    reference = full_forward_logits(model_f64, ids)[7:]
    assert relative_error(ours, reference) <= 1e-9


@pytest.mark.slow
def test_after_the_first_window_equals_the_tumbling_oracle(model_f64: Model) -> None:
    window, prompt_len = 4, 10  # the prompt itself crosses two window boundaries
    ids = model_f64.tokenizer.encode(TEXT)[:16]
    ours = teacher_forced(model_f64, f"windowed-checkpoint:window={window}", ids, prompt_len)
    oracle = tumbling_oracle_logits(model_f64, ids, window)[prompt_len - 1 :]
    assert relative_error(ours, oracle) <= 1e-9
    standard = full_forward_logits(model_f64, ids)[prompt_len - 1 :]
    assert relative_error(ours, standard) > 1e-3  # the documented loss is real
    # Each row differs: every position after the first window lost its earlier context.
    per_row = (ours - standard).abs().amax(dim=-1)
    assert (per_row > 1e-3).all()


@pytest.mark.parametrize("prompt_len", [8, 9])  # the open window holds 2 tokens / none
def test_batched_prefill_equals_token_by_token(model_f64: Model, prompt_len: int) -> None:
    """A prompt over several windows runs in one masked pass; feeding it token by token gives
    the same hidden rows, checkpoints, archive and state to decode on from."""
    ids = model_f64.tokenizer.encode(TEXT)[: prompt_len + 3]
    batched = WindowedCheckpointEngine(window=3)
    stepped = WindowedCheckpointEngine(window=3)
    h_batched = run(batched, model_f64, ids, prompt_len)
    h_stepped = run(stepped, model_f64, ids, 1)[prompt_len - 1 :]
    for a, b in zip(h_batched, h_stepped, strict=True):
        assert relative_error(a, b) <= 1e-10
    assert len(batched.checkpoints) == len(stepped.checkpoints) == len(ids) // 3
    for w in range(len(ids) // 3):
        a, b = batched.checkpoints.get(w), stepped.checkpoints.get(w)
        assert a is not None and b is not None and a.position == b.position == 3 * w + 2
        for ka, kb in zip(a.keys + a.values, b.keys + b.values, strict=True):
            assert relative_error(ka, kb) <= 1e-10
        archived = batched.archive.get(w)
        assert archived is not None and archived.offset == 3 * w
        assert archived.token_ids.tolist() == ids[3 * w : 3 * w + 3]
    assert batched.archive.pending == stepped.archive.pending
    assert list(batched.key_positions()) == list(stepped.key_positions())


def test_appendix_c_walk_through(model_f64: Model) -> None:
    """A worked example: window=3, prompt of 5, then decode at positions 5 and 6."""
    ids = model_f64.tokenizer.encode(TEXT)[:7]
    engine = WindowedCheckpointEngine(window=3)
    ffn = DenseFfn(model_f64)
    oracle = tumbling_oracle_logits(model_f64, ids, 3)
    with torch.inference_mode():
        h = engine.prefill(model_f64, ffn, ids[:5])
        # Window 0 = {0,1,2} closed: checkpoint = position 2, archive {0,1,2} at offset 0.
        assert engine.checkpoints.get(0).position == 2
        assert engine.archive.get(0).offset == 0
        assert engine.archive.get(0).token_ids.tolist() == ids[:3]
        # Window 1 holds {3,4} seeded by checkpoint 2; token 5 will attend {2,3,4,5}.
        assert engine.window_id == 1 and engine.window_tokens() == 2
        assert engine.key_positions() == range(2, 5)
        assert relative_error(final_logits(model_f64, h), oracle[4:5]) <= 1e-9

        h = engine.decode_step(model_f64, ffn, ids[5])
        # Window 1 is full: checkpoint = position 5, archive {3,4,5} at offset 3.
        assert engine.checkpoints.get(1).position == 5
        assert engine.archive.get(1).offset == 3
        assert engine.archive.get(1).token_ids.tolist() == ids[3:6]
        assert engine.window_id == 2 and engine.window_tokens() == 0
        assert engine.key_positions() == range(5, 6)  # token 6 attends {5, 6}
        assert relative_error(final_logits(model_f64, h), oracle[5:6]) <= 1e-9

        h = engine.decode_step(model_f64, ffn, ids[6])
        assert engine.window_tokens() == 1
        assert engine.key_positions() == range(5, 7)
        assert relative_error(final_logits(model_f64, h), oracle[6:7]) <= 1e-9


def test_replay_window_rebuilds_the_closed_windows_kv(model_f64: Model) -> None:
    ids = model_f64.tokenizer.encode(TEXT)[:9]
    engine = WindowedCheckpointEngine(window=4)
    run(engine, model_f64, ids[:7], 7)  # window 0 closed; window 1 holds positions 4, 5, 6
    open_kv = engine.current_window_kv()
    assert len(open_kv) == model_f64.config.num_layers and open_kv[0][0].shape[1] == 3
    with torch.inference_mode():
        engine.decode_step(model_f64, DenseFfn(model_f64), ids[7])  # closes window 1
    for window_id, live_rows in ((1, open_kv), (0, None)):
        replayed = engine.replay_window(window_id)
        checkpoint = engine.checkpoints.get(window_id)
        for layer, (k, v) in enumerate(replayed):
            assert k.shape[1] == v.shape[1] == 4
            # The last replayed row is the checkpoint the window left behind …
            assert relative_error(k[:, -1:], checkpoint.keys[layer]) <= 1e-10
            assert relative_error(v[:, -1:], checkpoint.values[layer]) <= 1e-10
            # … and the earlier rows are the K/V the open window held before it closed.
            if live_rows is not None:
                assert relative_error(k[:, :3], live_rows[layer][0]) <= 1e-10
                assert relative_error(v[:, :3], live_rows[layer][1]) <= 1e-10
    with pytest.raises(InvariantViolation):
        engine.replay_window(2)  # still open


def test_flush_closes_the_partial_window(model_f64: Model) -> None:
    ids = model_f64.tokenizer.encode(TEXT)[:9]
    engine = WindowedCheckpointEngine(window=4)
    run(engine, model_f64, ids[:6], 6)  # window 0 closed; window 1 holds positions 4, 5
    open_kv = engine.current_window_kv()
    cold = engine.memory().cold
    engine.flush()
    assert engine.window_tokens() == 0 and engine.window_id == 2 and engine.offset == 6
    assert engine.memory().cold > cold  # the checkpoint and the two ids are archived
    assert list(engine.key_positions()) == [5]  # the next token sees the flushed checkpoint
    replayed = engine.replay_window(1)
    for layer, (k, v) in enumerate(replayed):
        assert k.shape[1] == 2  # a partial window
        assert relative_error(k, open_kv[layer][0]) <= 1e-10
        assert relative_error(v, open_kv[layer][1]) <= 1e-10
    with torch.inference_mode():
        engine.decode_step(model_f64, DenseFfn(model_f64), ids[6])  # opens window 2
    assert engine.window_tokens() == 1 and list(engine.key_positions()) == [5, 6]
    engine.flush()
    engine.flush()  # nothing open: no change
    assert engine.window_id == 3 and len(engine.checkpoints) == 3


# ---------------------------------------------------------------------------- accounting


def test_stats_memory_and_info(model: Model) -> None:
    cfg = model.config
    ids = model.tokenizer.encode(TEXT)[:23]
    engine = WindowedCheckpointEngine(window=8)
    run(engine, model, ids, 20)  # 23 tokens: windows 0 and 1 closed, 7 tokens open
    stats = engine.stats()
    assert stats.windows == 2 and stats.tokens == 23
    row_bytes = cfg.num_layers * 2 * cfg.kv_dim * 4  # K+V of one row on every layer, float32
    assert stats.checkpoint_bytes == 2 * row_bytes
    assert stats.archive_bytes == 4 * 23
    assert stats.equivalent_kv_bytes == 23 * cfg.num_layers * cfg.kv_dim * 2 * 2
    ratio = stats.equivalent_kv_bytes / (2 * row_bytes + 4 * 23)
    assert stats.compression_ratio == pytest.approx(ratio)
    assert engine.summary() == f"2 windows / 23 tokens — {ratio:.0f}× compression vs full KV"

    memory = engine.memory()
    assert memory.cold == stats.checkpoint_bytes + stats.archive_bytes
    assert memory.derivative == 0
    live_rows = 1 + 7  # checkpoint row + the open window
    assert memory.hot >= live_rows * row_bytes
    assert engine.window_tokens() == 7
    info = engine.info()
    assert info.config == "window=8"
    assert "windows=2" in info.description and "tokens=23" in info.description


def test_memory_stays_bounded_by_the_window(model: Model) -> None:
    ids = model.tokenizer.encode(TEXT)[:14]
    engine = WindowedCheckpointEngine(window=3)
    ffn = DenseFfn(model)
    hot = []
    with torch.inference_mode():
        engine.prefill(model, ffn, ids[:2])
        for t in ids[2:]:
            engine.decode_step(model, ffn, t)
            hot.append(engine.memory().hot)
    cfg = model.config
    full_window = cfg.num_layers * 2 * (3 + 1) * cfg.kv_dim * 4  # 3 rows + the checkpoint row
    assert max(hot) <= full_window  # the live window never grows past its bound
    assert hot[3:6] == hot[6:9] == hot[9:12]  # and cycles window after window
    assert len(engine.checkpoints) == 14 // 3


def test_profiling_is_bit_identical_and_reports_stages(model: Model) -> None:
    ids = model.tokenizer.encode(TEXT)[:9]
    plain = WindowedCheckpointEngine(window=3)
    profiled = WindowedCheckpointEngine(window=3, profiling=True)
    for a, b in zip(run(plain, model, ids, 5), run(profiled, model, ids, 5), strict=True):
        assert torch.equal(a, b)
    assert plain.stage_summary() is None
    summary = profiled.stage_summary()
    assert summary is not None and summary.steps == 4
    assert summary.avg_attention_us > 0 and summary.avg_ffn_us > 0
    assert summary.avg_state_capture_us > 0  # windows closed during decode
    assert summary.avg_total_decode_us >= summary.avg_attention_us + summary.avg_ffn_us


class CountingFfn(DenseFfn):
    def __init__(self, model: Model) -> None:
        super().__init__(model)
        self.calls = 0

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(layer, x)


def test_the_given_ffn_backend_is_used(model: Model) -> None:
    ffn = CountingFfn(model)
    engine = WindowedCheckpointEngine(window=4)
    ids = model.tokenizer.encode(TEXT)[:6]
    with torch.inference_mode():
        engine.prefill(model, ffn, ids)  # one pass over both windows
        engine.decode_step(model, ffn, 42)
    assert ffn.calls == 2 * model.config.num_layers


def test_second_prefill_starts_afresh(model: Model) -> None:
    ids = model.tokenizer.encode(TEXT)[:10]
    engine = WindowedCheckpointEngine(window=4)
    first = run(engine, model, ids, 10)[-1]
    again = run(engine, model, ids, 10)[-1]
    assert torch.equal(first, again)
    assert len(engine.checkpoints) == 2 and engine.archive.total_tokens == 10


# ---------------------------------------------------------------------------- sliding layers


@pytest.mark.parametrize("window", [4, 9])  # narrower and wider than the sliding layers' 6
def test_tumbling_windows_on_sliding_layers(tiny_gemma3: Model, window: int) -> None:
    ids = random_ids(24, seed=3)
    ours = teacher_forced(tiny_gemma3, f"windowed-checkpoint:window={window}", ids, 14)
    oracle = tumbling_oracle_logits(tiny_gemma3, ids, window)[13:]
    assert relative_error(ours, oracle) <= 1e-9
