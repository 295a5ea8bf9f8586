"""What the tensor-parallel tests run on each rank (`larql.parallel.launch.run_ranks` spawns
the ranks and imports this module in each): a rank loads its share of a model, runs engines on
it, and rank 0 saves what they produced for the test to compare with one process's."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from helpers import teacher_forced
from larql.inference.ffn import DenseFfn
from larql.inference.generation import generate
from larql.inference.sampling import Sampler, SamplingParams
from larql.kv import parse_engine
from larql.models.model import load_model
from larql.models.shard import TensorShard


def engines_logits(shard: TensorShard, options: dict[str, Any]) -> None:
    """options['runs']: {model directory: [specs]}; each spec teacher-forced over
    options['ids'] on this rank's share of its model (float64). Rank 0 saves
    {(directory, spec): logits [N, V]} to options['out'], and every rank the tokens it fed in a
    sampled generation on the first model to options['out'].sampled.RANK."""
    torch.set_num_threads(1)
    results = {}
    for directory, specs in options["runs"].items():
        model = load_model(directory, dtype=torch.float64, shard=shard)
        for spec in specs:
            results[directory, spec] = teacher_forced(
                model, spec, options["ids"], options["prompt_len"]
            )
    # sampled without a seed, so each rank's own draws would differ: the ranks feed rank 0's
    model = load_model(next(iter(options["runs"])), dtype=torch.float64, shard=shard)
    engine = parse_engine("standard").build(model)
    sampler = Sampler(SamplingParams(temperature=1.0))
    ffn = DenseFfn(model)
    sampled = generate(engine, model, ffn, options["ids"], 12, sampler, stop_ids=frozenset())
    torch.save(sampled.tokens, f"{options['out']}.sampled.{shard.rank}")
    if shard.rank == 0:
        torch.save(results, options["out"])


def greedy_tokens(shard: TensorShard, options: dict[str, Any]) -> None:
    """Each of options['specs']'s greedy tokens and teacher-forced logits over them on this
    rank's share of each of options['models'] (float32), loaded with each of
    options['weights'] (`larql run`'s `--weights`); rank 0 saves
    {(model, weights, spec): (tokens, logits)} to options['out']."""
    torch.set_num_threads(1)
    results = {}
    for name in options["models"]:
        for weights in options["weights"]:
            model = load_model(name, weights=weights, shard=shard)
            ids = model.tokenizer.encode(options["prompt"])
            for spec in options["specs"]:
                engine = parse_engine(spec).build(model)
                ffn = DenseFfn(model)
                n = options["n"]
                tokens = generate(engine, model, ffn, ids, n, stop_ids=frozenset()).tokens
                logits = teacher_forced(model, spec, ids + tokens, len(ids))
                results[name, weights, spec] = (tokens, logits)
    if shard.rank == 0:
        torch.save(results, options["out"])


def one_rank_dies(shard: TensorShard, options: dict[str, Any]) -> None:
    """Rank 1 ends at once, without a word; rank 0 waits for it in an all-reduce."""
    if shard.rank == 1:
        os._exit(9)
    time.sleep(0.5)
    shard.all_reduce(torch.ones(4))


def one_rank_stalls(shard: TensorShard, options: dict[str, Any]) -> None:
    """Rank 1 stops answering (alive, silent) past the collectives' timeout; rank 0 waits for
    it in an all-reduce."""
    if shard.rank == 1:
        time.sleep(options["stall_s"])
    shard.all_reduce(torch.ones(4))


def server_loses_a_rank(shard: TensorShard, options: dict[str, Any]) -> None:
    """Rank 0 runs a server's scheduler with nothing to do (heartbeats every 0.2 s); rank 1
    follows one heartbeat, then leaves without an error (the launcher sees nothing wrong).
    Rank 0 saves what stopped its scheduler, and after how long, to options['out']."""
    from larql.server.app import create_app
    from larql.server.settings import ServerSettings
    from larql.server.tensor_parallel import MirroredSteps

    torch.set_num_threads(1)
    model = load_model(options["model"], shard=shard)
    if shard.rank == 1:
        shard.share(None)
        os._exit(0)
    app = create_app(model, ServerSettings(prefix_cache_bytes=0), MirroredSteps(shard, 0.2))
    scheduler = app.state.scheduler
    scheduler.claim_this_thread()
    started = time.monotonic()
    try:
        scheduler.run()
        raised = None
    except Exception as e:
        raised = type(e).__name__
    failure = str(scheduler.failure) if scheduler.failure is not None else None
    torch.save((raised, failure, time.monotonic() - started), options["out"])


def gloo_threads() -> list[str]:
    """The names of this process's threads that gloo runs (its workers and connection loop)."""
    tasks = Path("/proc/self/task")
    names = ((tasks / task / "comm").read_text().strip() for task in os.listdir(tasks))
    return sorted(name for name in names if "gloo" in name)


def join_reduce_and_leave(out: str) -> None:
    """A rank started as torchrun starts one (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in
    its environment): joins the group as a command does, runs a decode's collectives, leaves,
    and writes {before, after: its gloo threads before and after leaving, left: whether every
    rank was there} to `out`."""
    from larql.parallel.launch import join_from_environment, leave_group

    shard = join_from_environment(2, "cpu")
    shard.all_reduce(torch.ones(3, 8))
    shard.agree(5)
    shard.share({"calls": [("heartbeat",)]})
    before = gloo_threads()
    left = leave_group()
    Path(out).write_text(json.dumps({"before": before, "after": gloo_threads(), "left": left}))
