"""transformers as the reference oracle for the real GGUF models (loaded through transformers'
own GGUF path, independent of larql's loader)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch


def load_hf_gguf(path: Path) -> tuple[object, object]:
    """(model, tokenizer) from a .gguf file, float32, eager attention."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    with contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


@torch.no_grad()
def hf_greedy(model: object, ids: list[int], n: int) -> list[int]:
    out = model.generate(  # type: ignore[attr-defined]
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


@torch.no_grad()
def hf_logits(model: object, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()  # type: ignore[operator]


SAMPLE_TEXTS = [
    "The capital of France is",
    "Hello, world! How are you today?",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "Numbers 1234567890 and 3.14159, emoji 🙂 and accents: café, naïve, Zürich.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # square\n",
    "日本語のテキストと中文文本。",
]


def licence_text() -> str:
    return (Path(__file__).resolve().parents[1] / "LICENSE").read_text()
