"""Host work overlapped with the device's: the next batch read while the current one is encoded.

A stacked trellis call of 16 routed experts of GLM-5.3-Flash reads 16 matrices from the checkpoint, widens them to
float32 and stacks them (0.5 GB) before the GPU can start. Done in line, the GPU waits for every batch's reading;
here a worker thread prepares batch i + 1 while the caller encodes batch i (torch's copies release the GIL), and on
CUDA the stack lands in pinned memory, so its copy to the device does not stall the host either. The values are
the ones the in-line path makes, so the outputs are too.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Sequence, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


def ahead(items: Sequence[T], prepare: Callable[[T], R]) -> Iterator[tuple[T, R]]:
    """(item, prepare(item)) in order, the next item's `prepare` running on a worker thread while the caller works
    on the current one (one item ahead: memory for two prepared items at most). An error in `prepare` is raised
    where its item is reached."""
    if not items:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mixq-ahead") as pool:
        pending = pool.submit(prepare, items[0])
        try:
            for i, item in enumerate(items):
                ready = pending.result()
                pending = pool.submit(prepare, items[i + 1]) if i + 1 < len(items) else None
                yield item, ready
        finally:
            if pending is not None:  # the caller stopped early: drop the item read ahead
                pending.cancel()


def host_stack(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """float32 (len, ...) stack of `tensors` on the host, in pinned memory when it goes to a CUDA device next."""
    out = torch.stack([t.float() for t in tensors])
    return out.pin_memory() if device.type == "cuda" and torch.cuda.is_available() else out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; from pinned memory without waiting for the copy (the device's stream orders its use)."""
    return t.to(device, non_blocking=t.is_pinned())
