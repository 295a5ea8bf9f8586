"""Host values onto the device without waiting for it."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def ints_to_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """values → an int64 tensor [n] on `device`, without waiting for the device: a plain copy
    from pageable memory waits for everything queued on the stream (torch synchronises it),
    which would stall a step launched before the previous one was read; through pinned memory
    the copy is queued like a launch (the pinned block is not reused before it is done)."""
    return tensor_to_device(torch.tensor(values, dtype=torch.long), device)


def tensor_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor → a copy on `device`, queued without waiting for the device (as
    `ints_to_device`)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
