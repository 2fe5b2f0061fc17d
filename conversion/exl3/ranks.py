"""The EXL3 conversion over several ranks (runtime/distributed.py): what the pipeline needs beyond one process.

- `encode_batches`: the stacked trellis calls of a stage dealt to the ranks (the largest first, each to the least
  loaded rank); each result (stored tensors, and the dequantized weight when the next layer's calibration needs
  it) is shared with every rank, and every rank sees the results in batch order: the same batches, seeds and
  inputs as one process, so the same bytes (a batch encodes the same on any rank of one device type).
- `share_job` / `shared_state`: rank 0 alone owns the job in OUT (lock, parts, state files); the other ranks get
  a `FollowerJob` (the finished stages) and the calibration state to resume from.
- `scan_share`: the NaN/Inf scan of the source weights split over the ranks.
In a world of one every function here does exactly what the one-process pipeline did.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch

from mixq.runtime.distributed import RankContext, block_owner, deal
from mixq.runtime.overlap import ahead

# one quantize_batch result per unit: ({stored tensor name: tensor}, dequantized weight or None)
UnitResult = tuple[dict[str, torch.Tensor], "torch.Tensor | None"]
_SEP = "|"


def encode_batches(ranks: RankContext, groups: Sequence[list[int]], costs: Sequence[float],
                   prepare: Callable[[list[int]], Any], encode: Callable[[list[int], Any], list[UnitResult]], *,
                   keep_deq: bool) -> Iterator[tuple[list[int], list[UnitResult]]]:
    """(batch, its per-unit results) for every batch in order, on every rank. `encode(batch, prepare(batch))`:
    the inputs of the next batch this rank encodes are prepared on a worker thread meanwhile (runtime.overlap).
    One rank: `encode` is called lazily, batch by batch. Several: each rank encodes the batches `deal(costs)`
    gives it, then each batch's results travel from its rank to all; the dequantized weights travel only with
    `keep_deq` (else None)."""
    if ranks.world == 1:
        for g, inputs in ahead(groups, prepare):
            yield g, encode(g, inputs)
        return
    owner = deal(costs, ranks.world)
    mine_groups = [(i, g) for i, g in enumerate(groups) if owner[i] == ranks.rank]
    mine = {i: _flatten(encode(g, inputs), keep_deq)
            for (i, g), inputs in ahead(mine_groups, lambda ig: prepare(ig[1]))}
    for i, g in enumerate(groups):
        flat = ranks.share_tensors(mine.pop(i, None), src=owner[i], out_device="cpu")
        yield g, _unflatten(flat, len(g))


def _flatten(results: list[UnitResult], keep_deq: bool) -> dict[str, torch.Tensor]:
    """Per-unit results as one name -> tensor dict (insertion order kept: it is the stored tensors' order)."""
    flat = {}
    for j, (stored, deq) in enumerate(results):
        for name, t in stored.items():
            flat[f"{j}{_SEP}s{_SEP}{name}"] = t
        if keep_deq and deq is not None:
            flat[f"{j}{_SEP}d{_SEP}"] = deq
    return flat


def _unflatten(flat: dict[str, torch.Tensor], n: int) -> list[UnitResult]:
    stored: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    deq: list[torch.Tensor | None] = [None] * n
    for key, t in flat.items():
        j, kind, name = key.split(_SEP, 2)
        if kind == "s":
            stored[int(j)][name] = t
        else:
            deq[int(j)] = t
    return list(zip(stored, deq))


class FollowerJob:
    """A rank other than 0's view of the job: which stages are finished (rank 0 writes every file)."""

    def __init__(self, done: list[dict], extra: dict, fp: str) -> None:
        self.done, self.extra, self.fp = done, extra, fp

    def is_done(self, stage: str) -> bool:
        return any(d["stage"] == stage for d in self.done)

    def record(self, stage: str, part, *, state=None, **info) -> None:
        self.done.append({"stage": stage, **info})

    def release(self) -> None:
        """Nothing to release: rank 0 holds the lock."""


def share_job(ranks: RankContext, job):
    """Rank 0's job on rank 0; a FollowerJob with its finished stages on every other rank."""
    if ranks.world == 1:
        return job
    summary = ranks.broadcast_object({"done": job.done, "extra": job.extra, "fp": job.fp} if ranks.is_main
                                     else None)
    return job if ranks.is_main else FollowerJob(list(summary["done"]), dict(summary["extra"]), summary["fp"])


def shared_state(ranks: RankContext, job) -> tuple[str | None, dict[str, torch.Tensor] | None]:
    """(stage, tensors) of the calibration state to resume from, read by rank 0 and shared with every rank."""
    if ranks.world == 1:
        return job.load_state()
    stage, state = job.load_state() if ranks.is_main else (None, None)
    stage = ranks.broadcast_object(stage)
    if stage is None:
        return None, None
    return stage, ranks.share_tensors(state, src=0, out_device="cpu")


def scan_share(ranks: RankContext, names: Sequence[str]) -> list[str]:
    """This rank's block of `names` (all of them in a world of one)."""
    return [n for i, n in enumerate(names) if block_owner(i, len(names), ranks.world) == ranks.rank]
