"""A fused Triton kernel for the code descent of the Hessian rounding: one launch per window of columns.

:func:`rounding.hessian.refine_codes` moves every weight's level code one step up or down, column by column, where
that lowers tr(ΔW·H·ΔWᵀ); each move changes the gradient (W − Ŵ)·H of its row's later columns. Rows are independent
inside a window of columns (a move touches its own row only), so :func:`code_window` gives each program a tile of
rows x window columns of the gradient in registers and walks the window's columns in order: per column, the same
float32 operations as the eager sweep in the same order (no fused multiply-add), hence the same codes and the same
gradient, in one launch instead of about twenty small kernels per column (on a GPU the eager sweep waited on their
launches). The window's changes per row are written to `pending` for the caller's one matmul to the other columns.
"""
from __future__ import annotations

import torch

from mixq.quant.ggml.triton_kernels.search import launch_opts, triton, tl

ROWS = 16  # rows per program: a 16 x 256 float32 tile is 32 registers per thread at 4 warps


if triton is not None:
    @triton.jit
    def _window_kernel(grad_ptr, h_ptr, codes_ptr, up_ptr, dn_ptr, uph_ptr, dnh_ptr, okup_ptr, okdn_ptr, pend_ptr,
                       R, n, w0, width, h_expert_stride, pend_stride, ROWS: tl.constexpr, W: tl.constexpr):
        e = tl.program_id(0)
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        rm = rows < R
        cols = tl.arange(0, W)
        cm = cols < width
        row = (e * R + rows).to(tl.int64)
        at = row * n + w0                                   # (E, rows, n) tensors: this window's first column
        tile = rm[:, None] & cm[None, :]
        g_tile = tl.load(grad_ptr + at[:, None] + cols[None, :], mask=tile, other=0.0)
        hb = h_ptr + e.to(tl.int64) * h_expert_stride + w0
        for j in range(width):
            g = tl.sum(tl.where(cols[None, :] == j, g_tile, 0.0), axis=1)   # exact: one value and zeros
            g2 = 2.0 * g
            up = tl.load(up_ptr + at + j, mask=rm, other=0.0)
            dn = tl.load(dn_ptr + at + j, mask=rm, other=0.0)
            d_up = tl.where(tl.load(okup_ptr + at + j, mask=rm, other=0) != 0,
                            up * (tl.load(uph_ptr + at + j, mask=rm, other=0.0) - g2), 0.0)
            d_dn = tl.where(tl.load(okdn_ptr + at + j, mask=rm, other=0) != 0,
                            dn * (tl.load(dnh_ptr + at + j, mask=rm, other=0.0) - g2), 0.0)
            move = tl.where((d_up < d_dn) & (d_up < 0), 1.0, tl.where(d_dn < 0, -1.0, 0.0))
            delta = tl.where(move > 0, up, tl.where(move < 0, dn, 0.0)) * -1.0  # the change of W − Ŵ
            code = tl.load(codes_ptr + at + j, mask=rm, other=0.0)
            tl.store(codes_ptr + at + j, code + move, mask=rm)
            h_row = tl.load(hb + (w0 + j).to(tl.int64) * n + cols, mask=cm, other=0.0)
            g_tile = g_tile + delta[:, None] * h_row[None, :]
            tl.store(pend_ptr + row * pend_stride + j, 0.0 + delta, mask=rm)
        tl.store(grad_ptr + at[:, None] + cols[None, :], g_tile, mask=tile)


def code_window(grad: torch.Tensor, hessian: torch.Tensor, codes: torch.Tensor, up: torch.Tensor,
                dn: torch.Tensor, up_h: torch.Tensor, dn_h: torch.Tensor, ok_up: torch.Tensor, ok_dn: torch.Tensor,
                pending: torch.Tensor, w0: int, width: int) -> None:
    """One window's sweep, in place: `grad`, `codes` (float32), `up`/`dn` (decoded change of code ±1), `up_h`/
    `dn_h` (the same times diag H) and `ok_up`/`ok_dn` (int8: the move stays in range) are contiguous (E, rows, n);
    `hessian` (E|1, n, n); columns w0 .. w0 + width; `pending` (E, rows, >= width), contiguous, receives each
    column's change of W − Ŵ."""
    E, R, n = grad.shape
    W = triton.next_power_of_2(width)  # the tile's width
    stride = 0 if hessian.shape[0] == 1 else n * n
    _window_kernel[(E, triton.cdiv(R, ROWS))](grad, hessian, codes, up, dn, up_h, dn_h, ok_up, ok_dn, pending,
                                              R, n, w0, width, stride, pending.shape[-1], ROWS=ROWS, W=W, **launch_opts(grad.device))
