"""HF transformers' `generate` at several batch sizes: the peer for `larql bench --batch` on the
same HF directory. Every row gets the same prompt of `--prompt-tokens` tokens; greedy, exactly `-n`
new tokens. The decode rate is taken from two timed calls, one of 1 new token and one of n, so
the prefill is left out: aggregate tok/s = B · (n − 1) / (t_n − t_1); medians over repeats,
batch sizes interleaved.

    python benchmarks/hf_generate_batch.py DIR [--batch 1,16,64] [-n 32] [--prompt-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an HF model directory")
    parser.add_argument("--batch", default="1,16,64")
    parser.add_argument("-n", "--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", "--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    vocab = model.config.vocab_size
    prompt = torch.randint(
        0, vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0)
    )
    batches = [int(b) for b in args.batch.split(",")]

    def timed(batch: int, new: int) -> float:
        ids = prompt.repeat(batch, 1).to(args.device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        torch.cuda.synchronize()
        assert out.shape[1] == args.prompt_tokens + new
        return time.perf_counter() - t0

    for batch in batches:  # warm-up: kernels, allocator
        timed(batch, 2)
    times: dict[int, list[float]] = {b: [] for b in batches}
    for _ in range(args.repeats):
        for batch in batches:
            times[batch].append(timed(batch, args.new_tokens) - timed(batch, 1))
    for batch in batches:
        seconds = statistics.median(times[batch])
        steps = args.new_tokens - 1
        row = {
            "peer": "transformers generate",
            "batch": batch,
            "tok_s": round(batch * steps / seconds, 1),
            "ms_per_step": round(1000 * seconds / steps, 3),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
