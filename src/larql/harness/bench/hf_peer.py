"""HF transformers as the peer: `generate` with its DynamicCache on the same weights (loaded by
transformers itself from the same GGUF or HF directory), same dtype, threads and token counts.
transformers is optional; without it, a clear error says how to install it."""

from __future__ import annotations

import contextlib
import io
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from larql.errors import LarqlError
from larql.models.model import Model


class PeerUnavailable(LarqlError):
    """The peer library is not installed or cannot load this model."""


@dataclass
class PeerRow:
    label: str
    prompt_tokens: int
    new_tokens: int
    prefill_ms: float
    tok_s: float
    tok_s_runs: list[float] = field(default_factory=list)
    cache_bytes: int = 0
    tokens: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "prefill_ms": self.prefill_ms,
            "tok_s": self.tok_s,
            "tok_s_runs": self.tok_s_runs,
            "cache_bytes": self.cache_bytes,
        }


def load_hf_model(model: Model) -> Any:
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging
    except ImportError:
        raise PeerUnavailable(
            "--vs-hf needs HF transformers: pip install transformers accelerate"
        ) from None
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    source = model.source
    kwargs: dict[str, Any] = {"dtype": model.dtype}
    if source.is_file():
        kwargs["gguf_file"] = source.name
        source = source.parent
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            hf = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (ValueError, OSError, ImportError) as e:
        raise PeerUnavailable(f"transformers cannot load {model.source}: {e}") from None
    return hf.to(model.device).eval()


class _TokenClock:
    """A transformers streamer that timestamps every token `generate` emits."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        if value.device.type == "cuda":
            torch.cuda.synchronize(value.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def time_generate(
    hf_model: Any, ids: list[int], new_tokens: int, cache_implementation: str | None = None
) -> PeerRow:
    """One `generate` call; `cache_implementation="static"` is transformers' static cache
    (which `generate` compiles on its own where it can)."""
    clock = _TokenClock()
    extra = {"cache_implementation": cache_implementation} if cache_implementation else {}
    device = next(hf_model.parameters()).device
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids], device=device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            streamer=clock,
            pad_token_id=0,
            return_dict_in_generate=True,
            **extra,
        )
    # times[0]: the prompt echoed; times[1]: the first new token; then one per decode step
    first, last = clock.times[1], clock.times[-1]
    steps = len(clock.times) - 2
    cache = "StaticCache" if cache_implementation == "static" else "DynamicCache"
    return PeerRow(
        label=f"hf-transformers generate ({cache})",
        prompt_tokens=len(ids),
        new_tokens=new_tokens,
        prefill_ms=(first - t0) * 1000,
        tok_s=steps / (last - first) if steps > 0 else float("nan"),
        cache_bytes=_cache_bytes(out.past_key_values),
        tokens=out.sequences[0, len(ids) :].tolist(),
    )


def _cache_bytes(cache: Any) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def bench_hf(
    hf_model: Any,
    ids: list[int],
    new_tokens: int,
    repeats: int,
    cache_implementation: str | None = None,
    warmups: int = 1,
) -> PeerRow:
    for _ in range(warmups):
        time_generate(hf_model, ids, min(4, new_tokens), cache_implementation)
    runs = [time_generate(hf_model, ids, new_tokens, cache_implementation) for _ in range(repeats)]
    row = runs[len(runs) // 2]
    row.tok_s_runs = [r.tok_s for r in runs]
    row.tok_s = statistics.median(row.tok_s_runs)
    row.prefill_ms = statistics.median(r.prefill_ms for r in runs)
    return row
