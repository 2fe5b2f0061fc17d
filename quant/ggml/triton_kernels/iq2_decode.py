"""The IQ2 codes' decode of block-output tuning (block_tuning.IQ2Codes) in one Triton kernel.

Per 8-weight group the decode rounds each relaxed position to the signed table (half to even, clamped), looks the
rounded magnitudes' tuple up in the codebook, searches the codebook for the entry nearest to the interpolated
values where the tuple is none, evens the count of negatives for IQ2_XS (the weight of least |value|·magnitude
flips) and writes the signed magnitudes. Eager torch does this in many passes over every weight, with the groups
that need the search gathered and scattered through a host sync; the kernel does it in one pass, a block of groups
a program, and streams the codebook through registers only for blocks that hold such a group. The search keeps the
first entry of least score, as argmin does; its sums run in another order than the matmul's, so near-ties (within
float32 rounding) may go to the other entry.
"""
from __future__ import annotations

import torch

from mixq.quant.ggml.triton_kernels.search import launch_opts, triton, tl

if triton is not None:
    from mixq.quant.ggml.triton_kernels.iq2s import load8

GROUPS = 128    # groups per program


if triton is not None:
    @triton.jit
    def _decode_kernel(u_ptr, soft_ptr, entry_ptr, grid_ptr, norm_ptr, out_ptr, G, MAGS: tl.constexpr,
                       PARITY: tl.constexpr, GROUPS: tl.constexpr, ENTRIES: tl.constexpr):
        rows = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
        rm = rows < G
        cols = tl.arange(0, 8)
        at = rows.to(tl.int64)[:, None] * 8 + cols[None, :]
        m2 = rm[:, None] & (cols[None, :] < 8)
        u = tl.load(u_ptr + at, mask=m2, other=MAGS)
        # round half to even, as torch.round, then clamp to the table's 2·MAGS positions
        f = tl.floor(u)
        d = u - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        r = f + ((d > 0.5) | ((d == 0.5) & odd)).to(tl.float32)
        r = tl.minimum(tl.maximum(r, 0.0), 2 * MAGS - 1)
        neg = r < MAGS
        rank = tl.where(neg, MAGS - 1 - r, r - MAGS).to(tl.int32)
        weight = tl.full([8], 1, tl.int32)
        for i in tl.static_range(1, 8):
            weight = tl.where(cols >= i, weight * MAGS, weight)           # MAGS ** col
        key = tl.sum(rank * weight[None, :], axis=1)
        index = tl.load(entry_ptr + key, mask=rm, other=0)
        miss = (index < 0) & rm
        if tl.max(miss.to(tl.int32), axis=0) > 0:  # a group here is no codebook tuple: the nearest entry
            # each group's 8 values as scalars of its own (the sum over them then needs no exchange between lanes)
            a0, a1, a2, a3, a4, a5, a6, a7 = load8(soft_ptr + rows.to(tl.int64) * 8, rm)
            a0, a1, a2, a3 = tl.abs(a0), tl.abs(a1), tl.abs(a2), tl.abs(a3)
            a4, a5, a6, a7 = tl.abs(a4), tl.abs(a5), tl.abs(a6), tl.abs(a7)
            best = tl.full([GROUPS], float("inf"), tl.float32)
            pick = tl.zeros([GROUPS], tl.int64)
            for k in range(ENTRIES):
                c = grid_ptr + k * 8
                y = a0 * tl.load(c + 0) + a1 * tl.load(c + 1) + a2 * tl.load(c + 2) + a3 * tl.load(c + 3) \
                    + a4 * tl.load(c + 4) + a5 * tl.load(c + 5) + a6 * tl.load(c + 6) + a7 * tl.load(c + 7)
                score = tl.load(norm_ptr + k) - 2.0 * y
                take = score < best
                best = tl.where(take, score, best)
                pick = tl.where(take, k, pick)
            index = tl.where(miss, pick, index)
        index = tl.maximum(index, 0)
        mags = tl.load(grid_ptr + index[:, None] * 8 + cols[None, :], mask=m2, other=0.0)
        if PARITY:  # an odd count of negatives: the weight of least |value|·magnitude flips
            cost = tl.abs(tl.load(soft_ptr + at, mask=m2, other=0.0)) * mags
            low = tl.argmin(cost, axis=1, tie_break_left=True)
            flips = ((tl.sum(neg.to(tl.int32), axis=1) % 2) == 1)[:, None] & (cols[None, :] == low[:, None])
            neg = neg ^ flips
        tl.store(out_ptr + at, tl.where(neg, -mags, mags), mask=m2)


def decode(u: torch.Tensor, soft: torch.Tensor, entry: torch.Tensor, grid: torch.Tensor, norms: torch.Tensor,
           mags: int, parity: bool) -> torch.Tensor:
    """The signed codebook magnitudes (G, 8) float32 of the groups' relaxed positions u (G, 8) and their
    interpolated values soft (G, 8) on the signed table of 2·`mags` positions: entry (mags^8,) int64 maps a
    magnitude tuple's key (Σ rank_i·mags^i) to its codebook index or -1, grid (entries, 8) float32 the codebook,
    norms (entries,) its Σc²; `parity`: IQ2_XS's even count of negatives. All on one device."""
    G = u.shape[0]
    out = torch.empty(G, 8, dtype=torch.float32, device=u.device)
    if G == 0:
        return out
    _decode_kernel[(triton.cdiv(G, GROUPS),)](u.float().contiguous(), soft.float().contiguous(), entry.contiguous(),
                                              grid.float().contiguous(), norms.float().contiguous(), out, G,
                                              MAGS=mags, PARITY=parity, GROUPS=GROUPS, ENTRIES=grid.shape[0],
                                              **launch_opts(u.device))
    return out
