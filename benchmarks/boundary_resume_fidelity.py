"""How faithfully a context resumed from a boundary archive continues, against the same text run
in one go through `standard`.

A `boundary-kv:chunk_tokens=C,archive=DIR` engine takes the first `--prompt-len` tokens of the
text as a prompt, then the text's next tokens as decode steps up to `--archived` tokens, writing
frames as it goes (in the prompt and while decoding). `larql.resume` rebuilds that sequence from
the archive in a fresh `standard` engine, which is then fed the text's next `--positions` tokens as
decode steps. The reference is one uninterrupted `standard` run over the same ids (the same prompt,
then every later id a decode step). Printed: KL(standard ‖ resumed) per position (mean / max,
nats), top-1 agreement over those positions, and the free-running greedy continuation of
`--greedy` tokens from the resumed state against the reference's from the same point.

    .venv/bin/python benchmarks/boundary_resume_fidelity.py [--prompt-len 256] [--archived 512]
        [--chunk 64] [--positions 256] [--greedy 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile

import torch

import larql
from larql.api.resume_archive import rebuild
from larql.data import default_text, default_text_label
from larql.inference.ffn import DenseFfn
from larql.inference.layer import final_logits
from larql.kv.boundary import DirectoryBoundaryArchive


def archive_sequence(model: larql.Model, spec: str, ids: list[int], prompt_len: int) -> None:
    """The boundary-kv run that writes the archive: a prompt, then decode steps."""
    engine = larql.parse_engine(spec).build(model)
    ffn = DenseFfn(model)
    with torch.inference_mode():
        engine.prefill(model, ffn, ids[:prompt_len])
        for token in ids[prompt_len:]:
            engine.decode_step(model, ffn, token)


def continued_logits(state: larql.State, ids: list[int]) -> torch.Tensor:
    """Next-token logits after the state and after each of `ids` fed to a fork of it, [n + 1, V]
    (the last id's own row left out: [n, V])."""
    model, fork = state.model, state.fork()
    ffn = DenseFfn(model)
    rows = [fork.hidden]
    with torch.inference_mode():
        for token in ids[:-1]:
            rows.append(fork.engine.decode_step(model, ffn, token))
        return final_logits(model, torch.cat(rows)).double()  # [n, V]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--archived", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--greedy", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.archived % args.chunk or not 0 < args.prompt_len <= args.archived:
        sys.exit("--archived must be a multiple of --chunk, and --prompt-len in 1..--archived")

    model = larql.load_model(threads=args.threads)  # the default model, as `larql run` loads it
    ids = model.tokenizer.encode(default_text())[: args.archived + args.positions]
    with tempfile.TemporaryDirectory(prefix="larql-resume-") as archive:
        spec = f"boundary-kv:chunk_tokens={args.chunk},archive={archive}"
        archive_sequence(model, spec, ids[: args.archived], args.prompt_len)
        (sequence,) = DirectoryBoundaryArchive(archive).sequences()
        standard = larql.parse_engine("standard")
        state, resumed = rebuild(model, standard, sequence, archive=archive)

    later = ids[args.archived :]
    got = continued_logits(state, later)  # rows predict ids archived..archived + positions − 1
    reference = larql.teacher_forced_logits(model, "standard", ids, prompt_tokens=args.prompt_len)
    start = args.archived - args.prompt_len  # reference row i predicts id prompt_len + i
    want = reference[start : start + got.shape[0]].double()
    log_p, log_q = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [positions]
    top1 = (want.argmax(-1) == got.argmax(-1)).double().mean()

    greedy = larql.generate(model, state, "", max_new_tokens=args.greedy).token_ids
    one_go = larql.generate(model, "standard", ids[: args.archived], max_new_tokens=args.greedy)
    agree = next(
        (i for i, (a, b) in enumerate(zip(greedy, one_go.token_ids, strict=True)) if a != b),
        None,
    )

    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"model: {model.name} ({model.dtype}); text: {default_text_label()}")
    print(resumed.describe())
    print(
        f"| {args.archived} archived ({args.prompt_len} prompt + "
        f"{args.archived - args.prompt_len} decoded), chunk {args.chunk} | {got.shape[0]} "
        f"| {kl.mean():.2g} | {kl.max():.2g} | {100 * top1:.1f}% "
        f"| {'all ' + str(args.greedy) + ' equal' if agree is None else f'step {agree}'} "
        f"| {resumed.residual_distance:.2g} |"
    )


if __name__ == "__main__":
    main()
