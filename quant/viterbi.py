"""Tail-biting Viterbi over the 65,536-state bitshift trellis, vectorised over tiles (reference §3.6).

State s_p = ((s_{p-1} << D(p)) | v_p) & 0xFFFF, so the predecessors of s are the 2^D states whose low 16-D bits
equal s >> D. Costs are kept in float32 (the reference kernel uses fp16, which costs it accuracy).

Tail-biting is solved in two passes like the reference, but pass 1 is short: a free-start run over a window
around the ring seam (``warm`` positions before and after it) picks the seam edge, then pass 2 runs the full
ring constrained to start and end on that edge, which makes the ring self-consistent by construction.
"""
from __future__ import annotations

import torch

from .codebooks import step_bits

NSTATES = 65536
_INF = float("inf")


def default_warm(bits: float) -> int:
    """Seam window (positions each side) for pass 1: ~5 state lengths, enough for survivor paths to merge."""
    return min(128, 24 + int(64 // int(bits)))


def _min_over_top_bits(cost: torch.Tensor, dp: int) -> torch.Tensor:
    """min over the top dp bits of the state: (T, 65536) → (T, 65536 >> dp), as a halving tree (fast on CPU)."""
    a = cost
    for _ in range(dp):
        h = a.shape[1] >> 1
        a = torch.minimum(a[:, :h], a[:, h:])
    return a


def _dist(table2: torch.Tensor, table: torch.Tensor, xp: torch.Tensor) -> torch.Tensor:
    """(c − x)² − x² = c² − 2xc for every state (the x² term is common to all states, so it is dropped)."""
    return torch.addcmul(table2, xp, table, value=-2.0)


def _forward(x: torch.Tensor, table: torch.Tensor, table2: torch.Tensor, d: tuple[int, ...], positions: list[int],
             cost: torch.Tensor | None, keep_from: int) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Add-compare-select over ``positions``; returns the final cost and, from step keep_from on, each step's
    edge minima m (T, 65536 >> D): backpointers are recomputed from them during the traceback, which is much
    cheaper than an argmin with indices on every step.

    cost: (T, 65536) cost of the state before positions[0], or None for a free start.
    """
    t = x.shape[0]
    ms: list[torch.Tensor | None] = []
    for i, p in enumerate(positions):
        dp = d[p]
        dist = _dist(table2, table, x[:, p:p + 1])
        if cost is None:
            cost, m = dist, None
        else:
            m = _min_over_top_bits(cost, dp)
            cost = dist.view(t, NSTATES >> dp, 1 << dp).add_(m.unsqueeze(-1)).view(t, NSTATES)
        if i >= keep_from:
            ms.append(m)
    return cost, ms


def _traceback(last: torch.Tensor, ms: list[torch.Tensor | None], x: torch.Tensor, table: torch.Tensor,
               table2: torch.Tensor, d: tuple[int, ...], positions: list[int]) -> list[torch.Tensor]:
    """States at the last len(ms) positions, given the final state ``last`` (T,) int64.

    The predecessor of s at step j is the u minimising cost_{j-1}[(u << (16-D)) | (s >> D)], recomputed from the
    stored minima of step j-1: cost_{j-1}[q] = m_{j-1}[q >> D_{j-1}] + dist_{j-1}(q).
    """
    out = [last]
    s = last
    n = len(ms)
    off = len(positions) - n
    rows = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
    for j in range(n - 1, 0, -1):
        p, pp = positions[off + j], positions[off + j - 1]
        dp, dpp = d[p], d[pp]
        e = s >> dp
        cand = (torch.arange(1 << dp, device=x.device).unsqueeze(0) << (16 - dp)) | e.unsqueeze(1)  # (T, 2^D)
        c = torch.addcmul(table2[cand], x[:, pp:pp + 1], table[cand], value=-2.0)
        mprev = ms[j - 1]
        if mprev is not None:
            c = c + mprev[rows, cand >> dpp]
        u = c.argmin(dim=1)
        s = (u << (16 - dp)) | e
        out.append(s)
    out.reverse()
    return out


def viterbi_tiles(x: torch.Tensor, table: torch.Tensor, bits: float, warm: int | None = None) -> torch.Tensor:
    """Encode (T, 256) targets (tensor-core order) as consistent tail-biting rings; return (T, 256) int64 states."""
    d = step_bits(float(bits))
    warm = default_warm(bits) if warm is None else warm
    t = x.shape[0]
    x = x.float().contiguous()
    table2 = table * table
    # pass 1: free start `warm` positions before the seam, through the seam, `warm` positions past it
    seam = list(range(256 - warm, 256)) + list(range(warm))
    cost, ms = _forward(x, table, table2, d, seam, None, keep_from=warm - 1)
    best = cost.argmin(dim=1)
    s255 = _traceback(best, ms, x, table, table2, d, seam)[0] if warm > 0 else best
    d0 = d[0]
    edge = s255 & ((NSTATES >> d0) - 1)  # low 16-D(0) bits of s_255 = high bits of s_0
    # pass 2: whole ring from position 0, previous state restricted to the seam edge
    init = torch.full((t, 1 << d0, NSTATES >> d0), _INF, device=x.device)
    init.scatter_(2, edge.view(t, 1, 1).expand(t, 1 << d0, 1), 0.0)
    cost, ms = _forward(x, table, table2, d, list(range(256)), init.view(t, NSTATES), keep_from=0)
    # final state must end on the seam edge: s_255 = (u << (16-D0)) | edge
    ends = cost.view(t, 1 << d0, NSTATES >> d0).gather(2, edge.view(t, 1, 1).expand(t, 1 << d0, 1)).squeeze(2)
    u = ends.argmin(dim=1)
    last = (u << (16 - d0)) | edge
    return torch.stack(_traceback(last, ms, x, table, table2, d, list(range(256))), dim=1)


def viterbi_free(x: torch.Tensor, table: torch.Tensor, bits: float) -> torch.Tensor:
    """Free-start, free-end Viterbi MSE per tile (T,) — the cheap proxy used by the scale search."""
    d = step_bits(float(bits))
    x = x.float().contiguous()
    cost, _ = _forward(x, table, table * table, d, list(range(256)), None, keep_from=1 << 30)
    return (cost.min(dim=1).values + x.square().sum(1)) / 256.0


def encode_tiles(x: torch.Tensor, table: torch.Tensor, bits: float, max_bp_bytes: int | None = None,
                 warm: int | None = None) -> torch.Tensor:
    """Encode any number of tiles in chunks that bound the backpointer memory; returns (T, 256) int64 states."""
    if max_bp_bytes is None:
        max_bp_bytes = (8 << 30) if x.is_cuda else (192 << 20)
    dmin = min(step_bits(float(bits)))
    per_tile = 256 * 4 * (NSTATES >> dmin) + 4 * 4 * NSTATES
    chunk = max(1, max_bp_bytes // per_tile)
    outs = [viterbi_tiles(x[i:i + chunk], table, bits, warm) for i in range(0, x.shape[0], chunk)]
    return torch.cat(outs, 0) if outs else torch.zeros(0, 256, dtype=torch.int64, device=x.device)
