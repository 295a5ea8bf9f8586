"""`windowed-checkpoint` (alias `unlimited-context`): tumbling windows seeded by one-row K/V
checkpoints, every token id archived so a closed window can be replayed."""

from larql.kv.windowed_checkpoint.checkpoints import WindowedCheckpointStats
from larql.kv.windowed_checkpoint.engine import DEFAULT_WINDOW, WindowedCheckpointEngine
from larql.kv.windowed_checkpoint.entry import ENTRY

__all__ = ["DEFAULT_WINDOW", "ENTRY", "WindowedCheckpointEngine", "WindowedCheckpointStats"]
