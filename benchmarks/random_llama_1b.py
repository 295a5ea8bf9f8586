"""A Llama-3.2-1B-shaped HF directory with random bf16 weights, for speed at real scale on a GPU
(speed does not depend on the weights' values; fidelity is never measured on it).

    python benchmarks/random_llama_1b.py OUT_DIR [--tokenizer tokenizer.json] [--shape smollm2-135m]

`--shape smollm2-135m` gives SmolLM2-135M's shape instead (30 layers, hidden 576, 9 query / 3
K/V heads of 64, MLP 1536, RoPE base 100,000): the default model's speed on a GPU without
carrying its GGUF. Otherwise Llama-3.2-1B's: 16 layers, hidden 2048, 32 query / 8 K/V heads of
64, MLP 8192. Both tie the LM head over SmolLM2's vocabulary (49,152: its tokenizer.json is
written beside the weights — exported from the default model where no `--tokenizer` is given,
so the GPU machine needs no download). Built on the GPU where there is one (seconds), else on
the CPU.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 49152
SHAPES = {
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json of 49,152 tokens")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    args = parser.parse_args()
    config = LlamaConfig(
        **SHAPES[args.shape],
        head_dim=64,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.out)
    target = args.out / "tokenizer.json"
    if args.tokenizer is not None:
        shutil.copy(args.tokenizer, target)
    else:
        from larql.models import load_model

        load_model("smollm2-135m").tokenizer.tokenizer.save(str(target))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
