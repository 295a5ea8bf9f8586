"""Tensor parallelism (Megatron-style): each of N ranks holds a *sharded model*, its share of
every layer's query and K/V heads and of its MLP's width, and the full embeddings, LM head and
norms.

A rank's `Model` is an ordinary model whose config has 1/N of the heads and of the MLP width:
the Q/K/V projections keep the rank's output rows (whole heads, the K/V heads that its query
heads read), the output projection the matching input columns, gate/up their rows and down its
columns. Every engine sizes its per-head state from the config, so an engine on a rank keeps
that rank's heads and needs no change of its own. Only the layer math adds the partial outputs
of the ranks: one all-reduce after attention's output projection and one after the MLP's down
projection (`larql.inference.layer`), each before the bias, post-norm and residual add, which
every rank applies to the same sum.

A mixture-of-experts layer splits each expert the same way, by its intermediate width: a rank
holds 1/N of every expert's gate/up rows and the matching down columns (and likewise of the
shared expert), the router, the shared expert's gate and the routing scales whole. Every rank
routes the same replicated hidden state to the same experts, computes its share of each chosen
expert, and the one all-reduce after the MLP adds the shares, as for a dense MLP; an expert's
output bias is kept by rank 0 alone (zeros elsewhere), so the sum adds it once. Splitting by
experts instead (expert parallelism) would put a decode token's few chosen experts on one or two
ranks while the others wait, and needs an all-to-all; the column split keeps every rank's work
equal whatever the routing.

GGUF block matrices (`BlockRows`) are sliced the same way where the cut falls on whole blocks
of 32 (a head width or MLP share that is a multiple of 32), so a rank's products read the same
blocks, with the same per-block input rounding, as one process's; elsewhere the rank reads its
float rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from larql.errors import LarqlError
from larql.models.blocks import BLOCK, BLOCK_BYTES, BlockRows
from larql.models.config import ModelConfig

# how long a collective waits for the other ranks before the run ends with an error
DEFAULT_TIMEOUT = timedelta(seconds=120)


class TensorParallelError(LarqlError):
    """A model, engine or option that tensor parallelism cannot run as asked."""


class RankFailed(TensorParallelError):
    """Another rank of the group died or stopped answering."""


@dataclass
class TensorShard:
    """This process's place in a tensor-parallel group: rank `rank` of `world` (rank 0 tokenizes,
    samples and writes the output). `group`: the ranks' process group; None, the default group
    (the launcher's: a shard then holds no reference that keeps the group and its threads alive
    once the rank leaves it)."""

    rank: int
    world: int
    group: dist.ProcessGroup | None = field(default=None, repr=False)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The ranks' partial outputs [S, H] summed, on every rank (in place where it can)."""
        if self.world == 1:
            return partial
        summed = partial.contiguous()
        try:
            dist.all_reduce(summed, group=self.group)
        except RuntimeError as e:  # (torch.distributed's errors are RuntimeErrors)
            raise RankFailed(
                f"rank {self.rank}: a tensor-parallel all-reduce failed: {_line(e)}"
            ) from e
        return summed

    def total(self, counts: Sequence[int]) -> list[int]:
        """Every rank's `counts` summed, on every rank (what the whole run holds: each rank
        counts its own share)."""
        if self.world == 1:
            return list(counts)
        return [int(n) for n in self.all_reduce(torch.tensor(counts, dtype=torch.int64))]

    def share(self, payload: object) -> Any:
        """Rank 0's `payload` (any picklable value; another rank's is ignored), on every rank."""
        if self.world == 1:
            return payload
        held = [payload]
        try:
            dist.broadcast_object_list(held, src=0, group=self.group)
        except RuntimeError as e:
            raise RankFailed(
                f"rank {self.rank}: a tensor-parallel broadcast failed: {_line(e)}"
            ) from e
        return held[0]

    def agree(self, token: int) -> int:
        """Rank 0's token, on every rank (sampling draws on rank 0 alone: all ranks then feed
        the same token)."""
        if self.world == 1:
            return token
        held = torch.tensor([token], dtype=torch.long)
        try:
            dist.broadcast(held, src=0, group=self.group)
        except RuntimeError as e:
            raise RankFailed(f"rank {self.rank}: the token broadcast failed: {_line(e)}") from e
        return int(held.item())


def _line(error: Exception, limit: int = 240) -> str:
    """A collective's error on one line (gloo's run over several)."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _expert_widths(config: ModelConfig) -> list[int]:
    """The experts' and the shared expert's intermediate widths, where the config gives them."""
    routing = config.experts
    if routing is None:
        return []
    return [w for w in (routing.expert_width, routing.shared_width) if w]


def valid_sizes(config: ModelConfig) -> list[int]:
    """The tensor-parallel sizes that split `config` into whole heads and equal MLP shares: the
    divisors of the gcd of the query heads, every layer's K/V heads and MLP widths, and the
    experts' widths."""
    widths = [config.num_heads, *_expert_widths(config)]
    for layer in range(config.num_layers):
        widths.append(config.kv_heads_of(layer))
        widths.append(config.intermediate_size_of(layer))
    common = math.gcd(*widths)
    return [n for n in range(1, common + 1) if common % n == 0]


def check_splits(config: ModelConfig, world: int) -> None:
    """A typed one-line error where `config` cannot be split `world` ways (or cannot be split)."""
    if world < 1:
        raise TensorParallelError(f"--tensor-parallel must be ≥ 1, got {world}")
    if world == 1:
        return
    sizes = valid_sizes(config)
    if world not in sizes:
        kv = sorted({config.kv_heads_of(i) for i in range(config.num_layers)})
        mlp = sorted({config.intermediate_size_of(i) for i in range(config.num_layers)})
        routing = config.experts
        experts = ""
        if routing is not None and routing.expert_width:
            experts = f", expert width {routing.expert_width}"
        if routing is not None and routing.shared_width:
            experts += f", shared expert width {routing.shared_width}"
        raise TensorParallelError(
            f"--tensor-parallel {world} does not split {config.name or 'this model'} "
            f"({config.num_heads} query heads, {'/'.join(map(str, kv))} K/V heads, MLP width "
            f"{'/'.join(map(str, mlp))}{experts}) into equal shares; valid sizes: "
            f"{', '.join(map(str, sizes))}"
        )


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The config of one rank's share: 1/world of the heads and of the MLP width."""
    check_splits(config, world)
    layers = tuple(
        replace(
            spec,
            num_kv_heads=spec.num_kv_heads // world if spec.num_kv_heads else None,
            intermediate_size=spec.intermediate_size // world if spec.intermediate_size else None,
        )
        for spec in config.layers
    )
    routing = config.experts
    if routing is not None:
        routing = replace(
            routing,
            expert_width=routing.expert_width // world if routing.expert_width else None,
            shared_width=routing.shared_width // world if routing.shared_width else None,
        )
    return replace(
        config,
        num_heads=config.num_heads // world,
        num_kv_heads=config.num_kv_heads // world,
        intermediate_size=config.intermediate_size // world,
        layers=layers,
        experts=routing,
    )


def _share(size: int, rank: int, world: int) -> slice:
    if size % world:  # a width the config did not give (`check_splits` names the others)
        raise TensorParallelError(f"--tensor-parallel {world} does not divide a width of {size}")
    part = size // world
    return slice(rank * part, (rank + 1) * part)


# canonical per-layer names (`larql.models.weights`) and how each splits: by output rows (the
# rank's heads or MLP units), by input columns, or per query head
_HEAD_ROWS = {"wq": "q", "bq": "q", "wk": "kv", "bk": "kv", "wv": "kv", "bv": "kv"}
_MLP_ROWS = ("w_gate", "w_up")
_COLUMNS = {"wo": "q", "w_down": "mlp"}
# a mixture of experts' matrices → the axis of their intermediate width, cut as the MLP's (the
# width read from the tensor: experts and the shared expert have their own); the router, the
# shared expert's gate and the routing scales are whole
_EXPERT_AXES = {
    "experts_gate": 1,  # [E, F, H]
    "experts_up": 1,
    "experts_gate_bias": 1,  # [E, F]
    "experts_up_bias": 1,
    "experts_down": 2,  # [E, H, F]
    "shared_gate": 0,  # [Fs, H]
    "shared_up": 0,
    "shared_down": 1,  # [H, Fs]
}


def shard_state(
    config: ModelConfig, state: Mapping[str, torch.Tensor], rank: int, world: int
) -> dict[str, torch.Tensor]:
    """A canonical state dict (`larql.models.weights`) → rank's share of it; what does not split
    (embeddings, LM head, norms, output biases) is kept whole."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        cut = _cut(config, name, rank, world)
        out[name] = tensor if cut is None else cut(tensor)
    return out


def shard_blocks(
    config: ModelConfig, blocks: Mapping[str, BlockRows], rank: int, world: int
) -> dict[str, BlockRows]:
    """Canonical block matrices → rank's share (as `shard_state` cuts the float ones); a matrix
    whose column cut does not fall on whole blocks is left out (the rank reads its floats)."""
    out: dict[str, BlockRows] = {}
    for name, rows in blocks.items():
        part = _block_part(config, name, rows, rank, world)
        if part is not None:
            out[name] = part
    return out


def _layer_and_key(name: str) -> tuple[int, str] | None:
    if not name.startswith("layers."):
        return None
    _, index, key = name.split(".", 2)
    return int(index), key


def _cut(
    config: ModelConfig, name: str, rank: int, world: int
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How the canonical tensor `name` splits: a function of the full tensor, or None (kept)."""
    found = _layer_and_key(name)
    if found is None:
        return None
    key = found[1]
    if key == "experts_gate_up":  # [E, 2F, H], gate rows then up rows (Gemma 4)
        halves = _along(1, rank, world)
        return lambda t: torch.cat([halves(half) for half in t.chunk(2, dim=1)], dim=1)
    if key == "experts_down_bias":  # [E, H]: added once, by rank 0, to the ranks' sum
        return lambda t: t if rank == 0 else torch.zeros_like(t)
    if _plain_cut(config, name) is None:
        return None
    return lambda t: t[share_index(config, name, tuple(t.shape), rank, world)].contiguous()


def share_index(
    config: ModelConfig, name: str, shape: tuple[int, ...], rank: int, world: int
) -> tuple[slice, ...] | None:
    """The rank's share of the canonical tensor `name` (whole: `shape`) as one index into it —
    what `shard_state` keeps of it, so a loader can read that slice alone; None where the
    tensor is kept whole or is not cut as one slice (the two halves of Gemma 4's fused experts,
    an expert's output bias: `shard_state` cuts those). Besides the canonical names it takes
    one expert's matrix before the experts are stacked (`layers.i.experts.j.w_gate`)."""
    plain = _plain_cut(config, name)
    if plain is None:
        return None
    axis, width = plain
    return (slice(None),) * axis + (_share(width or shape[axis], rank, world),)


# one expert's matrix before stacking: its axes are the stacked tensor's less the first
_ONE_EXPERT = {"w_gate": "experts_gate", "w_up": "experts_up", "w_down": "experts_down"}


def _plain_cut(config: ModelConfig, name: str) -> tuple[int, int | None] | None:
    """The axis along which `name` is cut as one slice and the whole width cut there (None:
    the tensor's own size along that axis); None where it is not."""
    found = _layer_and_key(name)
    if found is None:
        return None
    layer, key = found
    dim = config.head_dim_of(layer)
    widths = {
        "q": config.num_heads * dim,
        "kv": config.kv_heads_of(layer) * dim,
        "mlp": config.intermediate_size_of(layer),
    }
    if key in _HEAD_ROWS:
        return 0, widths[_HEAD_ROWS[key]]
    if key in _MLP_ROWS:
        return 0, widths["mlp"]
    if key in _COLUMNS:
        return 1, widths[_COLUMNS[key]]
    if key == "attn_sinks":  # one logit per query head
        return 0, config.num_heads
    if key in _EXPERT_AXES:
        return _EXPERT_AXES[key], None
    expert, _, matrix = key.rpartition(".")
    if expert.startswith("experts.") and matrix in _ONE_EXPERT:
        return _EXPERT_AXES[_ONE_EXPERT[matrix]] - 1, None
    return None


def _along(axis: int, rank: int, world: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The rank's share of a tensor along `axis`, the width read from the tensor."""

    def cut(t: torch.Tensor) -> torch.Tensor:
        index = (slice(None),) * axis + (_share(t.shape[axis], rank, world),)
        return t[index].contiguous()

    return cut


def _block_part(
    config: ModelConfig, name: str, rows: BlockRows, rank: int, world: int
) -> BlockRows | None:
    found = _layer_and_key(name)
    if found is None:
        return rows  # the LM head (or tied embeddings): whole on every rank
    if rows.tiled:
        return None  # tiled blocks are read whole; shards are cut at load, before any tiling
    key = found[1]
    if key in _EXPERT_AXES:
        return None  # the experts' products read their float weights
    if key in _HEAD_ROWS or key in _MLP_ROWS:
        share = _share(rows.out_features, rank, world)
        return replace(rows, data=rows.data[share].contiguous())
    if key in _COLUMNS:
        columns = _share(rows.in_features, rank, world)
        if columns.start % BLOCK or (columns.stop - columns.start) % BLOCK:
            return None
        width = BLOCK_BYTES[rows.format]
        data = rows.data[:, columns.start // BLOCK * width : columns.stop // BLOCK * width]
        return replace(rows, data=data.contiguous(), in_features=columns.stop - columns.start)
    return rows
