"""A fused Triton kernel for the IQ2 codebook search of the Hessian rounding: the k nearest entries per group.

The rounding scores all the codebook entries (IQ2_S: 1024, IQ2_XS: 512) for every 8-weight group of every row, in a
diagonal metric m:
score(c) = s²·Σ m_i·c_i² − 2s·Σ m_i·|t_i|·c_i (the squared error up to a constant; s the group's scale, t its
targets). Eager torch writes that (rows, entries) score table to memory and reads it back once per entry it picks;
:func:`nearest_entries` streams the codebook through registers instead, keeping each row's k best (value, index)
as it goes, and returns them ascending (ties to the lower index, as argmin and topk order them). The sums over
the 8 weights run in index order, so a score can differ from the matmul's in the last bit: near-ties may pick the
other entry, which the exact quadratic that follows scores either way.
"""
from __future__ import annotations

import torch

from mixq.quant.ggml.triton_kernels.search import launch_opts, triton, tl

ROWS = 128      # rows per program


if triton is not None:
    @triton.jit
    def load8(p, mask):
        """The eight values p[0], ..., p[7] of an 8-weight group, each a tile shaped like `mask` (0 where masked)."""
        return (tl.load(p + 0, mask=mask, other=0.0), tl.load(p + 1, mask=mask, other=0.0),
                tl.load(p + 2, mask=mask, other=0.0), tl.load(p + 3, mask=mask, other=0.0),
                tl.load(p + 4, mask=mask, other=0.0), tl.load(p + 5, mask=mask, other=0.0),
                tl.load(p + 6, mask=mask, other=0.0), tl.load(p + 7, mask=mask, other=0.0))

    @triton.jit
    def _nearest_kernel(s_ptr, a_ptr, c2m_ptr, grid_ptr, out_ptr, R, c2m_stride, K: tl.constexpr,
                        ROWS: tl.constexpr, ENTRIES: tl.constexpr):
        e = tl.program_id(0)
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        rm = rows < R
        row = (e * R + rows).to(tl.int64)
        s = tl.load(s_ptr + row, mask=rm, other=0.0)
        ss = s * s
        s2 = 2.0 * s
        a0, a1, a2, a3, a4, a5, a6, a7 = load8(a_ptr + row * 8, rm)  # m_i·|t_i| of the row's group
        c2m = c2m_ptr + e.to(tl.int64) * c2m_stride
        slot = tl.arange(0, K)
        vals = tl.full([ROWS, K], float("inf"), tl.float32)
        ids = tl.zeros([ROWS, K], tl.int32) - 1 - slot[None, :]   # distinct placeholders, evicted first
        worst = tl.max(vals, axis=1)
        worst_id = tl.max(tl.where(vals == worst[:, None], ids, -2147483647), axis=1)
        for k in range(ENTRIES):
            c = grid_ptr + k * 8
            y = a0 * tl.load(c + 0) + a1 * tl.load(c + 1) + a2 * tl.load(c + 2) + a3 * tl.load(c + 3) \
                + a4 * tl.load(c + 4) + a5 * tl.load(c + 5) + a6 * tl.load(c + 6) + a7 * tl.load(c + 7)
            score = ss * tl.load(c2m + k) - s2 * y
            take = (score < worst)[:, None] & (ids == worst_id[:, None])
            vals = tl.where(take, score[:, None], vals)
            ids = tl.where(take, k, ids)
            worst = tl.max(vals, axis=1)
            worst_id = tl.max(tl.where(vals == worst[:, None], ids, -2147483647), axis=1)
        for i in tl.static_range(K):  # ascending by (score, index)
            low = tl.min(vals, axis=1)
            pick = tl.min(tl.where(vals == low[:, None], ids, 2147483647), axis=1)
            tl.store(out_ptr + row * K + i, tl.maximum(pick, 0).to(tl.int64), mask=rm)
            vals = tl.where(ids == pick[:, None], float("inf"), vals)


def nearest_entries(scale: torch.Tensor, metric: torch.Tensor, target: torch.Tensor, grid: torch.Tensor,
                    k: int) -> torch.Tensor:
    """Indices (E, rows, k) int64 of the k codebook entries of smallest score (module docstring), ascending.

    scale (E, rows, 1) or (E, rows); metric (E|1, 8); target (E, rows, 8); grid (entries, 8) float32, on one device;
    k a power of two."""
    E, R, _ = target.shape
    s = scale.reshape(E, R).float().contiguous()
    a = (metric.unsqueeze(-2) * target.abs()).float().contiguous()            # (E, rows, 8)
    c2m = ((grid * grid) @ metric.float().unsqueeze(-1)).squeeze(-1).contiguous()  # (E|1, entries)
    out = torch.empty(E, R, k, dtype=torch.int64, device=target.device)
    entries = grid.shape[0]
    stride = 0 if c2m.shape[0] == 1 else entries
    _nearest_kernel[(E, triton.cdiv(R, ROWS))](s, a, c2m, grid.float().contiguous(), out, R, stride, K=k,
                                               ROWS=ROWS, ENTRIES=entries, **launch_opts(target.device))
    return out
