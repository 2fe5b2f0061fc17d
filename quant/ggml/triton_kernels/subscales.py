"""A fused Triton kernel for the sub-block scale descent of the Hessian rounding: one launch per window of columns.

:func:`rounding.hessian.refine_sub_scales` takes the sub-blocks (16 or 32 weights) in column order and tries each
one's integer scale ±1 and min ±1, keeping the move that lowers tr(ΔW·H·ΔWᵀ) most; eagerly that is about twenty
small kernels per sub-block, and on a GPU their launches were a fifth of the call. Rows are independent inside a
window of columns (a move changes its own row's gradient only), so :func:`sub_scale_window` gives each program a
tile of rows x window columns of the gradient (W − Ŵ)·H in registers, laid out as (rows, sub-blocks, weights) so
one reduction over the middle axis reads a sub-block, and walks the window's sub-blocks in order with the eager
step: the candidates in the eager order (scale +1, −1, then min +1, −1), each ΔL = −2·sign·Σa·g + a·H_ss·a,
the strictly lowest negative one kept (an earlier candidate wins a tie). a·H_ss·a depends on the fixed slopes and
H only, so it comes in precomputed rather than as a sub x sub product per sub-block. The window's changes of
W − Ŵ per row are written to `pending` for the caller's one matmul to the other columns.

The same candidates and order as the eager loop; the sums over a sub-block and the gradient's updates (one outer
product per column, the eager loop's matmul) run in another order, so a near-tie can go the other way.
"""
from __future__ import annotations

import torch

from mixq.quant.ggml.triton_kernels.search import launch_opts, triton, tl

ROWS = 16  # rows per program: a 16 x 256 float32 gradient tile is 32 registers per thread at 4 warps


if triton is not None:
    @triton.jit
    def _candidate(dl, ok, best, choice, k):
        """The eager step's comparison: an admissible candidate k replaces the best where strictly lower."""
        dl = tl.where(ok, dl, 0.0)
        better = dl < best
        return tl.where(better, dl, best), tl.where(better, k, choice)

    @triton.jit
    def _window_kernel(grad_ptr, h_ptr, sc_ptr, mn_ptr, asc_ptr, amn_ptr, qsc_ptr, qmn_ptr, pend_ptr,
                       R, n, w0, width, h_expert_stride, pend_stride, sc_lo, sc_hi, mn_lo, mn_hi,
                       MINS: tl.constexpr, SUB: tl.constexpr, ROWS: tl.constexpr, W: tl.constexpr):
        e = tl.program_id(0)
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        rm = rows < R
        lane = tl.arange(0, SUB)
        blk = tl.arange(0, W // SUB)
        row = (e * R + rows).to(tl.int64)
        offs = blk[:, None] * SUB + lane[None, :]                                           # (W / SUB, SUB)
        cm = offs < width
        tile = rm[:, None, None] & cm[None, :, :]
        at = row * n + w0                                   # (E, rows, n) tensors: this window's first column
        gw = tl.load(grad_ptr + at[:, None, None] + offs[None, :, :], mask=tile, other=0.0)
        hb = h_ptr + e.to(tl.int64) * h_expert_stride
        nsub = n // SUB
        for s in range(width // SUB):
            c0 = w0 + s * SUB                               # the sub-block's first column
            sidx = row * nsub + c0 // SUB                   # (E, rows, sub-blocks) tensors
            g = tl.sum(tl.where((blk == s)[None, :, None], gw, 0.0), axis=1)                # exact: (ROWS, SUB)
            ap = row[:, None] * n + c0 + lane[None, :]
            a_sc = tl.load(asc_ptr + ap, mask=rm[:, None], other=0.0)
            lin = tl.sum(a_sc * g, axis=1)
            quad = tl.load(qsc_ptr + sidx, mask=rm, other=0.0)
            v_sc = tl.load(sc_ptr + sidx, mask=rm, other=0)
            best = tl.zeros([ROWS], tl.float32)
            choice = tl.full([ROWS], -1, tl.int32)
            best, choice = _candidate(-2.0 * lin + quad, (v_sc + 1 >= sc_lo) & (v_sc + 1 <= sc_hi), best, choice, 0)
            best, choice = _candidate(2.0 * lin + quad, (v_sc - 1 >= sc_lo) & (v_sc - 1 <= sc_hi), best, choice, 1)
            if MINS:
                a_mn = tl.load(amn_ptr + ap, mask=rm[:, None], other=0.0)
                lin_m = tl.sum(a_mn * g, axis=1)
                quad_m = tl.load(qmn_ptr + sidx, mask=rm, other=0.0)
                v_mn = tl.load(mn_ptr + sidx, mask=rm, other=0)
                best, choice = _candidate(-2.0 * lin_m + quad_m, (v_mn + 1 >= mn_lo) & (v_mn + 1 <= mn_hi),
                                          best, choice, 2)
                best, choice = _candidate(2.0 * lin_m + quad_m, (v_mn - 1 >= mn_lo) & (v_mn - 1 <= mn_hi),
                                          best, choice, 3)
                tl.store(mn_ptr + sidx, v_mn + tl.where(choice == 2, 1, tl.where(choice == 3, -1, 0)), mask=rm)
            tl.store(sc_ptr + sidx, v_sc + tl.where(choice == 0, 1, tl.where(choice == 1, -1, 0)), mask=rm)
            # the change of W − Ŵ is −sign·a (Ŵ moves by sign·a); the window gets it ⊗ H[column, window]
            for i in range(SUB):
                a_i = tl.load(asc_ptr + at + (c0 - w0) + i, mask=rm, other=0.0)
                change = tl.where(choice == 0, a_i * -1.0, tl.where(choice == 1, a_i, 0.0))
                if MINS:
                    m_i = tl.load(amn_ptr + at + (c0 - w0) + i, mask=rm, other=0.0)
                    change = tl.where(choice == 2, m_i * -1.0, tl.where(choice == 3, m_i, change))
                h_row = tl.load(hb + (c0 + i).to(tl.int64) * n + w0 + offs, mask=cm, other=0.0)
                gw = gw + change[:, None, None] * h_row[None, :, :]
                tl.store(pend_ptr + row * pend_stride + (c0 - w0) + i, 0.0 + change, mask=rm)
        tl.store(grad_ptr + at[:, None, None] + offs[None, :, :], gw, mask=tile)


def sub_block_quads(slope: torch.Tensor, hss: torch.Tensor) -> torch.Tensor:
    """a·H_ss·a per sub-block: slope (E, rows, n) float32 (a decoded weight's change per unit of the field),
    hss (E|1, sub-blocks, sub, sub) the Hessian's diagonal blocks -> (E, rows, n / sub) float32, contiguous; the
    eager step's products, batched over sub-blocks (a sub-block's slopes and H_ss stay fixed through a sweep)."""
    E, R, n = slope.shape
    sub = hss.shape[-1]
    a = slope.unflatten(-1, (n // sub, sub)).transpose(1, 2)            # (E, sub-blocks, rows, sub)
    return ((a @ hss) * a).sum(-1).transpose(1, 2).contiguous()


def sub_scale_window(grad: torch.Tensor, hessian: torch.Tensor, vals_sc: torch.Tensor, vals_mn: torch.Tensor | None,
                     slope_sc: torch.Tensor, slope_mn: torch.Tensor | None, quad_sc: torch.Tensor,
                     quad_mn: torch.Tensor | None, pending: torch.Tensor, w0: int, width: int, sub: int,
                     sc_range: tuple[int, int], mn_range: tuple[int, int] | None) -> None:
    """One window's sub-block scale descent, in place: `grad` (the gradient (W − Ŵ)·H) and `slope_sc`/`slope_mn`
    (a decoded weight's change per unit of scale / min) float32 (E, rows, n); `vals_sc`/`vals_mn` (the integer
    fields, int64) and `quad_sc`/`quad_mn` (:func:`sub_block_quads`) (E, rows, n / sub); all contiguous, the
    min's None for types without mins. `hessian` (E|1, n, n) contiguous; columns w0 .. w0 + width (multiples of
    `sub`, a power of two); `pending` (E, rows, >= width), contiguous, receives each column's change of W − Ŵ."""
    if w0 % sub or width % sub:
        raise ValueError(f"sub_scale_window: window {w0}..{w0 + width} does not align with sub-blocks of {sub}")
    E, R, n = grad.shape
    W = max(triton.next_power_of_2(width), sub)  # the tile's width
    stride = 0 if hessian.shape[0] == 1 else n * n
    mins = vals_mn is not None
    mn_lo, mn_hi = mn_range if mins else (0, 0)
    # without mins the min's pointers are never read: the scale's stand in
    _window_kernel[(E, triton.cdiv(R, ROWS))](
        grad, hessian, vals_sc, vals_mn if mins else vals_sc, slope_sc, slope_mn if mins else slope_sc, quad_sc,
        quad_mn if mins else quad_sc, pending, R, n, w0, width, stride, pending.shape[-1], sc_range[0], sc_range[1],
        mn_lo, mn_hi, MINS=mins, SUB=sub, ROWS=ROWS, W=W, **launch_opts(grad.device))
