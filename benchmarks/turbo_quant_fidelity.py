"""What turbo-quant's quantised K/V costs in fidelity, and what it saves in memory.

Teacher-forces a natural text (the repository's LICENSE by default: a few hundred prompt tokens,
then the forced positions) through `standard` and through `turbo-quant:bits=2|3|4`, and prints
per engine KL(standard ‖ engine) over the forced positions (mean / median / p99 / max, nats),
top-1 agreement, ln(PPL_engine / PPL_standard) on the text's own next tokens, and the K/V bytes
held vs an fp16 full cache of the same length. It also prints the codec's MSE distortion
E‖x − x̂‖² on random unit vectors at the model's head_dim (Lloyd–Max theory for a Gaussian
coordinate: 0.1175 / 0.0345 / 0.0095), and the relative distortion ‖x − x̂‖²/‖x‖² on the model's
real K and V rows of the prompt.

The fair baseline (anchors.md: llama.cpp rotates before quantising a KV cache) is plain per-row
absmax integer quantisation, with and without the same Walsh–Hadamard rotation, at the same byte
budget per vector (a float32 scale + packed codes); it runs through the very same engine with
only the codec swapped (`--baseline-bits ''` skips it). A `+norm-fix` row shows TurboQuant with
the stored norm rescaled so the decoded vector keeps the original length (same bytes).

    .venv/bin/python benchmarks/turbo_quant_fidelity.py [--prompt-len 256] [--positions 128]
        [--bits 2,3,4] [--baseline-bits 3,4,8] [--threads 2]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from larql.inference.engine import Engine
from larql.inference.ffn import DenseFfn
from larql.inference.forward import run_layers
from larql.inference.generation import teacher_forced_logits
from larql.inference.layer import embed, recompute_kv, token_tensor
from larql.kv import parse_engine
from larql.kv.turbo_quant import RowCodec, TurboQuantCodec, TurboQuantEngine
from larql.kv.turbo_quant.codec import join_norms, split_norms
from larql.kv.turbo_quant.packing import pack_indices, packed_size, unpack_indices
from larql.kv.turbo_quant.rotation import next_power_of_two, rotation_matrix
from larql.models import Model, load_model, parse_dtype

ROOT = Path(__file__).resolve().parents[1]
LLOYD_MAX_MSE = {2: 0.1175, 3: 0.0345, 4: 0.0095}


class AbsmaxCodec:
    """Baseline: symmetric per-vector absmax integer codes, optionally after the signed WHT.
    One vector = [scale: f32][codes packed at `bits`], the same budget as TurboQuant's."""

    def __init__(self, dim: int, bits: int, rotate: bool) -> None:
        self.dim, self.bits, self.rotate = dim, bits, rotate
        self.coded_dim = next_power_of_two(dim) if rotate else dim
        self.levels = (1 << (bits - 1)) - 1  # codes −levels..levels
        self.bytes_per_vector = 4 + packed_size(self.coded_dim, bits)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x.float(), (0, self.coded_dim - self.dim))  # [N, d']
        if self.rotate:
            x = x @ rotation_matrix(self.coded_dim, torch.float32, x.device)
        scale = x.abs().amax(dim=-1) / self.levels  # [N]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
        codes = torch.round(x / safe).clamp(-self.levels, self.levels) + self.levels
        return join_norms(scale, pack_indices(codes.to(torch.uint8), self.bits))

    def decode(self, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scale, payload = split_norms(data)
        codes = unpack_indices(payload, self.coded_dim, self.bits).float() - self.levels
        x = codes * scale  # [N, d']
        if self.rotate:
            x = x @ rotation_matrix(self.coded_dim, torch.float32, x.device)
        return x[:, : self.dim].to(dtype)


class NormCorrectedCodec(TurboQuantCodec):
    """TurboQuant with the stored norm chosen so the decoded vector keeps ‖x‖ (the Lloyd–Max
    reconstruction of a unit vector is shorter than 1 by about the distortion, which shrinks
    every attention logit). Same bytes, same decoder; a variant to compare, not the engine's."""

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        data = super().encode(x)
        decoded = super().decode(data, torch.float32)
        norms, payload = split_norms(data)
        length = torch.linalg.vector_norm(decoded, dim=-1, keepdim=True)  # [N, 1]
        target = torch.linalg.vector_norm(x.float(), dim=-1, keepdim=True)
        corrected = torch.where(length > 0, norms * target / length.clamp_min(1e-30), norms)
        return join_norms(corrected.flatten(), payload)


def kl_per_position(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Logits [N, V] twice → KL(softmax(reference) ‖ softmax(other)) per row [N], nats."""
    log_p = torch.log_softmax(reference.double(), dim=-1)
    log_q = torch.log_softmax(other.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def mean_nll(logits: torch.Tensor, targets: list[int]) -> float:
    """Mean negative log-likelihood of `targets` under logits rows [len(targets), V]."""
    log_p = torch.log_softmax(logits[: len(targets)].double(), dim=-1)
    return -log_p[torch.arange(len(targets)), torch.tensor(targets)].mean().item()


def random_unit_mse(codec: RowCodec, dim: int, n: int = 20_000) -> float:
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(0))
    x = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return ((x - codec.decode(codec.encode(x), torch.float32)) ** 2).sum(-1).mean().item()


def prompt_kv(model: Model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's K and V rows of the prompt, each [L·Hkv·S, D] (through the shared path)."""
    residuals: list[torch.Tensor] = []
    with torch.inference_mode():
        h = embed(model, token_tensor(model, ids))
        residuals.append(h)
        run_layers(model, DenseFfn(model), h, after_layer=lambda _, out: residuals.append(out))
        kv = [
            recompute_kv(model, layer, residuals[layer], 0) for layer in range(len(residuals) - 1)
        ]
    ks, vs = zip(*kv, strict=True)
    d = model.config.head_dim
    return torch.cat(ks).reshape(-1, d), torch.cat(vs).reshape(-1, d)


def relative_mse(codec: RowCodec, x: torch.Tensor) -> float:
    """Mean ‖x − x̂‖² / ‖x‖² over rows."""
    decoded = codec.decode(codec.encode(x), torch.float32)
    x = x.float()
    return (((x - decoded) ** 2).sum(-1) / (x**2).sum(-1).clamp_min(1e-30)).mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--text", type=Path, default=ROOT / "LICENSE")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--positions", type=int, default=128, help="teacher-forced positions")
    parser.add_argument("--bits", default="2,3,4")
    parser.add_argument("--baseline-bits", default="3,4,8", help="absmax baselines ('' = none)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print("$ " + shlex.join([Path(sys.executable).name, *sys.argv]))
    model = load_model(args.model, dtype=parse_dtype(args.dtype))
    cfg = model.config
    ffn = DenseFfn(model)
    ids = model.tokenizer.encode(args.text.read_text())[: args.prompt_len + args.positions - 1]
    if len(ids) <= args.prompt_len:
        raise SystemExit(f"{args.text} has only {len(ids)} tokens")
    positions = len(ids) - args.prompt_len + 1
    fp16_bytes = cfg.kv_bytes_per_token(2) * len(ids)
    print(
        f"model={model.name} dtype={args.dtype} head_dim={cfg.head_dim} layers={cfg.num_layers} "
        f"kv_heads={cfg.num_kv_heads} text={args.text.name} prompt={args.prompt_len} "
        f"positions={positions} tokens_stored={len(ids)} fp16_full_kv={fp16_bytes:,} B"
    )

    def run(engine: Engine) -> tuple[torch.Tensor, int]:
        logits = teacher_forced_logits(engine, model, ffn, ids, args.prompt_len)
        return logits, engine.memory_bytes()

    reference, _ = run(parse_engine("standard").build(model))
    targets = ids[args.prompt_len :]
    reference_nll = mean_nll(reference, targets)
    keys, values = prompt_kv(model, ids[: args.prompt_len])

    rows: list[tuple[str, RowCodec, Callable[[], Engine]]] = []
    for bits in (int(b) for b in args.bits.split(",") if b):
        rows.append(
            (
                f"turbo-quant:bits={bits}",
                TurboQuantCodec(cfg.head_dim, bits),
                lambda bits=bits: parse_engine(f"turbo-quant:bits={bits}").build(model),
            )
        )
        rows.append(
            (
                f"tq{bits} +norm-fix",
                NormCorrectedCodec(cfg.head_dim, bits),
                lambda bits=bits: TurboQuantEngine(
                    bits=bits, codec_factory=lambda d: NormCorrectedCodec(d, bits)
                ),
            )
        )
    for bits in (int(b) for b in args.baseline_bits.split(",") if b):
        for rotate in (False, True):
            name = f"absmax int{bits}" + (" +WHT" if rotate else "")
            factory = lambda d, bits=bits, rotate=rotate: AbsmaxCodec(d, bits, rotate)  # noqa: E731
            rows.append(
                (
                    name,
                    factory(cfg.head_dim),
                    lambda f=factory, bits=bits: TurboQuantEngine(bits=bits, codec_factory=f),
                )
            )

    header = (
        f"{'engine':<22} {'B/vec':>5} {'KV bytes':>10} {'vs fp16':>7} {'mean KL':>9} "
        f"{'median':>9} {'p99':>9} {'max':>9} {'top-1':>6} {'ΔlnPPL':>8} "
        f"{'MSE unit':>9} {'relMSE K':>9} {'relMSE V':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, codec, build in rows:
        logits, held = run(build())
        kl = kl_per_position(reference, logits)
        top1 = (logits.argmax(-1) == reference.argmax(-1)).double().mean().item()
        dppl = mean_nll(logits, targets) - reference_nll
        print(
            f"{name:<22} {codec.bytes_per_vector:>5} {held:>10,} {fp16_bytes / held:>6.2f}x "
            f"{kl.mean().item():>9.4f} {kl.median().item():>9.4f} "
            f"{kl.quantile(0.99).item():>9.4f} {kl.max().item():>9.4f} {100 * top1:>5.1f}% "
            f"{dppl:>+8.4f} {random_unit_mse(codec, cfg.head_dim):>9.5f} "
            f"{relative_mse(codec, keys):>9.5f} {relative_mse(codec, values):>9.5f}"
        )
    print(
        "MSE unit = E‖x − x̂‖² on 20,000 random unit vectors at head_dim (Lloyd–Max theory: "
        + ", ".join(f"{b} bits {v}" for b, v in LLOYD_MAX_MSE.items())
        + "); relMSE K/V = mean ‖x − x̂‖²/‖x‖² over the prompt's real K/V rows, all layers."
    )


if __name__ == "__main__":
    main()
