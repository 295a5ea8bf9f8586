"""The walk FFN (top-k features by |activated gate|) against the dense FFN, and `larql walk` as
a user calls it: the feature table, JSON, --predict through the engine dispatch, --compare."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from larql.cli.app import app
from larql.inference.ffn import DenseFfn, build_ffn
from larql.inference.ffn.introspect import down_tokens, firing_features
from larql.inference.ffn.walk import WalkFfn
from larql.inference.forward import run_layers
from larql.inference.generation import generate, teacher_forced_logits
from larql.inference.layer import embed, final_logits, token_tensor
from larql.kv import parse_engine
from larql.kv.resolve import ENV_VAR
from larql.models import Model

TEXT = (
    "The capital of France is Paris. The capital of Germany is Berlin. Water boils at 100 "
    "degrees Celsius at sea level, and the"
)
FEATURES = 1536  # SmolLM2-135M intermediate size


def normed_inputs(model: Model, ids: list[int]) -> dict[int, torch.Tensor]:
    """Every layer's real pre-FFN-normed input for `ids`: {layer: [S, H]}."""
    inputs: dict[int, torch.Tensor] = {}

    class Record(DenseFfn):
        def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
            inputs[layer] = x.clone()
            return super().forward(layer, x)

    with torch.inference_mode():
        run_layers(model, Record(model), embed(model, token_tensor(model, ids)))
    return inputs


def kl_rows(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    log_p = torch.log_softmax(p_logits.double(), -1)
    log_q = torch.log_softmax(q_logits.double(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


# ---------------------------------------------------------------------------- walk vs dense


@pytest.fixture(scope="module")
def text_inputs(smollm2: Model) -> dict[int, torch.Tensor]:
    """Every layer's normed input for TEXT, computed once for the cases below: {layer: [S, H]}."""
    return normed_inputs(smollm2, smollm2.tokenizer.encode(TEXT))


@pytest.fixture(scope="module")
def layer7_inputs_f64(smollm2_f64: Model) -> torch.Tensor:
    """Layer 7's normed input for 100 tokens of TEXT in float64, [100, H]: each case of the
    top-k sum takes its last rows."""
    return normed_inputs(smollm2_f64, (smollm2_f64.tokenizer.encode(TEXT) * 4)[:100])[7]


@pytest.mark.parametrize("k", [None, FEATURES, FEATURES + 1, 10**9])
def test_walk_without_a_real_k_is_bit_identical_to_dense(
    smollm2: Model, text_inputs: dict[int, torch.Tensor], k: int | None
) -> None:
    walk, dense = WalkFfn(smollm2, k), DenseFfn(smollm2)
    assert walk.is_dense
    for layer, x in text_inputs.items():
        assert torch.equal(walk.forward(layer, x), dense.forward(layer, x))


@pytest.mark.slow
def test_walk_policy_generation_is_bit_identical_to_dense(smollm2: Model) -> None:
    ids, text = smollm2.tokenizer.encode("The capital of France is"), smollm2.tokenizer.encode(TEXT)
    engine = parse_engine("standard")
    # the prefill and 4 teacher-forced decode steps: bit-identity holds at every one
    walked = teacher_forced_logits(
        engine.build(smollm2), smollm2, build_ffn(smollm2, "walk"), text, len(text) - 4
    )
    dense = teacher_forced_logits(
        engine.build(smollm2), smollm2, DenseFfn(smollm2), text, len(text) - 4
    )
    assert len(dense) == 5 and torch.equal(walked, dense)
    a = generate(engine.build(smollm2), smollm2, build_ffn(smollm2, "walk:k=none"), ids, 4)
    b = generate(engine.build(smollm2), smollm2, DenseFfn(smollm2), ids, 4)
    assert a.tokens == b.tokens


@pytest.mark.parametrize("rows", [1, 100])  # decode, and a prefill crossing the gather chunks
@pytest.mark.parametrize("k", [1, 100, 1535])
def test_walk_is_the_sum_over_its_top_k_features(
    smollm2_f64: Model, layer7_inputs_f64: torch.Tensor, k: int, rows: int
) -> None:
    """Σ over the k features with the largest |act(gate)| of act·up·down — checked against a
    masked dense computation in float64."""
    model = smollm2_f64
    x = layer7_inputs_f64[-rows:]  # [rows, H]
    lw = model.weights.layers[7]
    gate, up = F.linear(x, lw.w_gate_up).chunk(2, dim=-1)
    act = F.silu(gate)
    keep = torch.zeros_like(act).scatter_(1, act.abs().topk(k, dim=-1).indices, 1.0)
    expected = F.linear(act * up * keep, lw.w_down)
    got = WalkFfn(model, k).forward(7, x)
    assert (got - expected).abs().max().item() <= 1e-10 * expected.abs().max().item()


@pytest.mark.slow
def test_walk_with_most_features_changes_the_output_but_stays_close(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(TEXT)
    engine = parse_engine("standard")
    start = len(ids) - 10  # the prefill's last position and 10 decode steps (11 positions)
    dense = teacher_forced_logits(engine.build(smollm2), smollm2, DenseFfn(smollm2), ids, start)
    walked = teacher_forced_logits(
        engine.build(smollm2), smollm2, build_ffn(smollm2, "walk:k=1024"), ids, start
    )
    kl = kl_rows(dense, walked)
    agree = (dense.argmax(-1) == walked.argmax(-1)).double().mean().item()
    print(
        f"walk:k=1024 on every layer: KL mean {kl.mean():.4f} max {kl.max():.4f} nats, "
        f"top-1 agreement {agree:.3f} over {len(kl)} positions"
    )
    assert not torch.equal(dense, walked)
    assert kl.mean().item() < 0.5 and agree >= 0.75


@pytest.mark.slow
def test_fewer_features_drift_further(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(TEXT)[:12]  # the KLs differ many-fold at 12 positions
    with torch.inference_mode():
        h = embed(smollm2, token_tensor(smollm2, ids))
        dense = final_logits(smollm2, run_layers(smollm2, DenseFfn(smollm2), h))
        kls = []
        for k in (1024, 512, 100):
            walked = final_logits(smollm2, run_layers(smollm2, WalkFfn(smollm2, k), h))
            kls.append(kl_rows(dense, walked).mean().item())
    print("mean KL at k=1024, 512, 100:", [round(v, 4) for v in kls])
    assert kls[0] < kls[1] < kls[2]


def test_firing_features_are_the_walks_largest_contributions(smollm2: Model) -> None:
    x = normed_inputs(smollm2, smollm2.tokenizer.encode("The capital of France is"))[20][-1]
    top = firing_features(smollm2, 20, x, None, 5)
    lw = smollm2.weights.layers[20]
    gate, up = F.linear(x, lw.w_gate_up).chunk(2)
    coefficient = F.silu(gate) * up
    assert [f.feature for f in top] == coefficient.abs().topk(5).indices.tolist()
    assert top[0].activation == pytest.approx(coefficient[top[0].feature].item(), rel=1e-5)
    kept = firing_features(smollm2, 20, x, 10, 50)  # only the walk's 10 features can show
    assert len(kept) == 10
    assert {f.feature for f in kept} == set(F.silu(gate).abs().topk(10).indices.tolist())
    tokens = down_tokens(smollm2, 20, top[0].feature, 3)
    column = lw.w_down[:, top[0].feature]
    assert tokens == (smollm2.weights.lm_head @ column).topk(3).indices.tolist()


# ---------------------------------------------------------------------------- larql walk


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, smollm2: Model):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr("larql.cli.walk_cmd.open_model", lambda *a, **k: smollm2)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["walk", *args])


def test_walk_table(cli) -> None:
    result = cli("The capital of France is", "-k", "200", "--layers", "28-29", "--top", "3")
    assert result.exit_code == 0, result.output
    assert "features firing at position 4" in result.stdout
    assert "walk:k=200" in result.stdout and "writes" in result.stdout


def test_walk_json(cli, smollm2: Model) -> None:
    result = cli("The capital of France is", "--layers", "29", "--top", "4", "-o", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ffn"] == "walk" and data["position"] == 4
    assert data["prediction"][0]["text"] == " Paris"
    (layer,) = data["layers"]
    assert layer["layer"] == 29 and len(layer["features"]) == 4
    first = layer["features"][0]
    assert set(first) == {"feature", "activation", "gate", "writes"} and len(first["writes"]) == 5
    # a token is {id, text} as everywhere in the JSON: the text is the id's
    tokenizer = smollm2.tokenizer
    assert all(w["text"] == tokenizer.decode([w["id"]]) for w in first["writes"])
    assert abs(first["activation"]) >= abs(layer["features"][-1]["activation"])


@pytest.mark.slow
def test_walk_predict_goes_through_the_engine(cli, smollm2: Model) -> None:
    args = ("The capital of France is", "--predict", "-n", "2", "-o", "json")
    dense = json.loads(cli(*args, "--ffn-policy", "dense").stdout)
    walked = json.loads(cli(*args, "-k", "1536", "--engine", "markov-rs").stdout)
    assert walked["ffn"] == "walk:k=1536" and walked["engine"] == "markov-rs"
    assert walked["token_ids"] == dense["token_ids"] and len(dense["token_ids"]) == 2
    assert dense["text"].startswith(" Paris")
    sparse = json.loads(cli(*args, "--ffn-policy", "{walk:k=50}@layers=0-29").stdout)
    assert sparse["ffn"] == "{walk:k=50}@layers=0-29"
    text = cli("The capital of France is", "--predict", "-n", "2")
    assert text.exit_code == 0 and "engine standard, ffn walk" in text.stderr


def test_walk_predict_refuses_apollo(cli) -> None:
    result = cli("x", "--predict", "--engine", "apollo")
    assert result.exit_code == 2 and "not available for live decode" in result.stderr


def test_walk_compare(cli) -> None:
    result = cli("The capital of France is", "-k", "100", "--compare", "-o", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["dense"][0]["text"] == " Paris" and len(data["walk"]) == 5
    assert set(data["dense"][0]) == {"id", "text", "probability"}  # as run --top names them
    assert data["kl_dense_walk"] > 0
    same = json.loads(cli("The capital of France is", "--compare", "-o", "json").stdout)
    assert same["kl_dense_walk"] == 0 and same["same_top1"]
    table = cli("The capital of France is", "-k", "1024", "--compare")
    assert table.exit_code == 0 and "KL(dense ‖ walk:k=1024)" in table.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("-k", "5", "--ffn-policy", "dense"), "not both"),
        (("--ffn-policy", "{walk}@layers=0-3"), "layer 4 is bound by no binding"),
        (("--ffn-policy", "{dense}@layers=0-40"), "binds layer 40"),
        (("--ffn-policy", "wal:k=3"), "unknown FFN backend 'wal'"),
        (("--layers", "5-99"), "outside the model's layers"),
        (("--predict", "--compare"), "not both"),
        (("-k", "0"), "must be ≥ 1"),
        (("--ffn", "http://127.0.0.1:9"), "give --predict or --compare"),
        (("--ffn", "http://127.0.0.1:9", "-k", "5", "--compare"), "not both"),
        (("--predict", "--kv-cache", "nonsense"), "unknown --kv-cache"),
    ],
)
def test_walk_errors_are_one_line(cli, args: tuple[str, ...], message: str) -> None:
    result = cli("The capital of France is", *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output


def test_walk_predict_takes_the_legacy_engine_flags(cli) -> None:
    args = ("The capital of France is", "--predict", "-n", "2", "-o", "json")
    data = json.loads(cli(*args, "--kv-cache", "markov-bounded", "--context-window", "8").stdout)
    assert data["engine"] == "standard:window=8"


def test_walk_compare_against_an_ffn_shard(cli, smollm2: Model) -> None:
    """--ffn URL: the shard runs every layer's FFN; over the f32 wire it is the dense FFN."""
    from larql.server.ffn_shard import create_ffn_app, start_shard

    with start_shard(create_ffn_app(smollm2)) as shard:
        result = cli("The capital of France is", "--compare", "--ffn", shard.url, "-o", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ffn"] == f"remote-walk:endpoint={shard.url}"
    assert data["kl_dense_walk"] < 1e-9 and data["same_top1"]
