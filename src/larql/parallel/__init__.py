"""More than one process per model: tensor parallelism on torch.distributed (`shard`: what
each rank holds and how the ranks' outputs are summed; `launch`: starting and joining the
ranks)."""
