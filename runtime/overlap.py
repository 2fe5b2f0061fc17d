"""Host work overlapped with the device's: the next batch read while the current one is encoded, a finished stage
written while the next one runs, and the copies between host and device made at the transfer engine's speed.

A stacked trellis call of 16 routed experts of GLM-5.3-Flash reads 16 matrices from the checkpoint, widens them to
float32 and stacks them (0.5 GB) before the GPU can start. Done in line, the GPU waits for every batch's reading;
here a worker thread prepares batch i + 1 while the caller encodes batch i (torch's copies release the GIL), and on
CUDA the stack lands in pinned memory, so its copy to the device does not stall the host either. The values are
the ones the in-line path makes, so the outputs are too.

The dequantized weights of a layer come back to the host for the next layer's calibration (7.25 G float32 weights
in a GLM-5.3-Flash MoE layer). Copied into fresh pageable memory, every 32 MiB expert is faulted in page by page
and staged by the driver; `to_host` copies into pinned blocks instead, which torch's host allocator hands out
again to the next layer's copies, and the advance pass reads them back to the device from pinned memory too.

A finished EXL3 layer's part file and job record (its calibration state, 2 GB of hidden streams at 64 x 512
calibration tokens of GLM-5.3-Flash) take seconds of disk writing; `WriteBehind` runs them on a worker thread while
the next layer's calibration forward keeps the device busy, one at a time and in order.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
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
    """float32 (len, ...) stack of `tensors` on the host, in pinned memory when it goes to a CUDA device next (stacked
    there directly: one copy, not a pageable stack copied again into pinned memory)."""
    out = host_empty((len(tensors), *tensors[0].shape), torch.float32,
                     pinned=device.type == "cuda" and torch.cuda.is_available())
    return torch.stack([t.float() for t in tensors], out=out)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; from pinned memory without waiting for the copy (the device's stream orders its use)."""
    return t.to(device, non_blocking=t.is_pinned())


def host_empty(shape: Sequence[int], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """An uninitialised host tensor; in pinned memory when `pinned` and the host can lock more of it (else pageable:
    slower copies, the same values)."""
    if pinned:
        try:
            return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)
        except RuntimeError:
            pass
    return torch.empty(tuple(shape), dtype=dtype)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host (the same values); from a CUDA device into pinned memory. A host tensor is returned as it is."""
    if t.device.type != "cuda":
        return t.cpu()
    out = host_empty(t.shape, t.dtype, pinned=True)
    out.copy_(t)  # waits for the copy: the caller may read the values next
    return out


class WriteBehind:
    """Run tasks on one worker thread, in order, at most one in flight: `submit` first waits for the task before
    (raising its error, so a failed write stops the caller at its next stage), and leaving the `with` block waits
    for the last one. When the block is left by an error, the task in flight still finishes (a job record is
    whole or not written) and the block's error is the one raised."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mixq-write")
        self._pending: Future | None = None

    def submit(self, task: Callable[[], object]) -> None:
        self.wait()
        self._pending = self._pool.submit(task)

    def wait(self) -> None:
        """Block until the task in flight is done; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __enter__(self) -> "WriteBehind":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.wait()
            elif self._pending is not None:
                self._pending.exception()  # let it finish; the block's own error is raised
        finally:
            self._pool.shutdown(wait=True)
