"""`mixq eval` over several ranks (runtime/distributed.py): windows dealt to ranks, per-window scalars to rank 0.

Each rank runs the reference and the candidates over its own windows only. Windows are dealt in whole batches of
`batch_windows` (contiguous blocks of batches, rank 0 first), so every window runs in the same batch as in one
process and gives the same logits bit for bit. Per window, a rank keeps only the per-token quantities
(runtime/kl_stats.token_quantities: a few float64 per scored position); rank 0 gathers them and adds them in window
order, so its report holds the one-process numbers (timings aside: seconds are summed over the ranks).
"""
from __future__ import annotations

import torch

from mixq.runtime.distributed import RankContext, block_owner


def rank_window_ids(count: int, batch_windows: int, ranks: RankContext) -> list[int]:
    """The indices of this rank's windows among `count` (all of them in a world of one)."""
    if ranks.world == 1:
        return list(range(count))
    n_batches = -(-count // batch_windows)
    return [w for w in range(count) if block_owner(w // batch_windows, n_batches, ranks.world) == ranks.rank]


def gather_in_order(ranks: RankContext, ids: list[int], quantities: list[dict[str, torch.Tensor]],
                    seconds: float) -> tuple[list[dict[str, torch.Tensor]], float] | None:
    """On rank 0: every rank's per-window quantities (`ids[i]` is the window of `quantities[i]`) in window
    order, and the ranks' seconds summed (device time); None on the other ranks."""
    got = ranks.gather_objects((ids, quantities, seconds))
    if got is None:
        return None
    by_window = {w: q for r_ids, r_qs, _ in got for w, q in zip(r_ids, r_qs)}
    return [by_window[w] for w in sorted(by_window)], sum(s for _, _, s in got)
