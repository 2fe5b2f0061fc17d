"""A fused Triton kernel for the IQ2_S group-wise descent of the Hessian rounding: one launch per window of columns.

:func:`rounding.hessian.refine_iq2` takes the 8-weight codebook groups in column order; per group it solves for the
unconstrained best values given the other groups (v + g_B·H_BB⁻¹), takes their signs, shortlists the
``IQ2_SHORTLIST`` codebook entries nearest to their magnitudes in the diagonal metric diag(H_BB), scores each with
the exact change of tr(ΔW·H·ΔWᵀ) (2δ·g_B + δ·H_BB·δᵀ) and keeps the best where that is negative. Eagerly that is
about thirty small kernels per group, and on a GPU their launches were most of the sweep's time. Rows are
independent inside a window of columns (a group's move changes its own row's gradient only), so
:func:`iq2s_window` gives each program a tile of rows x window columns of the gradient (W − Ŵ)·H in registers and
walks the window's groups in order, doing the whole group step there: the shortlist is the streamed codebook search
of :mod:`triton_kernels.iq2s`, a chunk of entries at a time, each score packed with its entry's index into one int64 key
ordered as (score, index) pairs, so one min finds a chunk's best and the lower index wins a tie; a chunk's K best
replace the running list's worst in turn, and the 1024 scores never reach memory. The window's changes per row are
written to `pending` for the caller's one matmul to the other columns.

Not bit-exact with the eager loop: H_BB⁻¹ is an inverse made once per call (the eager loop solves per group) and
the kernel's sums run in another order, so near-ties can go the other way; each move still lowers the quadratic.
"""
from __future__ import annotations

import torch

from mixq.quant.ggml.triton_kernels.search import launch_opts, triton, tl

if triton is not None:  # (without Triton neither module has kernels)
    from mixq.quant.ggml.triton_kernels.iq2s import load8

ROWS = 16       # rows per program: a 16 x 256 float32 gradient tile is 32 registers per thread at 4 warps
CHUNK = 128     # codebook entries scored at once: a 16 x 128 tile of int64 keys is another 32 registers per thread
ENTRIES = 1024  # IQ2_S codebook entries
WARPS = 4       # warps per program


if triton is not None:
    @triton.jit
    def _sort_key(score, idx):
        """int64 keys ordered as (score, entry) pairs: the float's bits made monotone (a negative float's magnitude
        bits flipped; -0 turned into +0 first) above the entry index, so one min gives the best score's lowest entry."""
        bits = (score + 0.0).to(tl.int32, bitcast=True)
        mono = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        return (mono.to(tl.int64) << 32) | idx.to(tl.int64)

    @triton.jit
    def _dot8(p, x0, x1, x2, x3, x4, x5, x6, x7):
        """Σ_j p[j]·x_j: a row of an 8 x 8 matrix in memory times one tile per weight, summed in index order."""
        return tl.load(p) * x0 + tl.load(p + 1) * x1 + tl.load(p + 2) * x2 + tl.load(p + 3) * x3 \
            + tl.load(p + 4) * x4 + tl.load(p + 5) * x5 + tl.load(p + 6) * x6 + tl.load(p + 7) * x7

    @triton.jit
    def _column(x, lane, i):
        """Weight i of a (rows, 8) tile (exact: a sum of one value and zeros)."""
        return tl.sum(tl.where(lane[None, :] == i, x, 0.0), axis=1)

    @triton.jit
    def _weight(v, d, c_ptr, ideal):
        """One weight of the shortlist (rows, K): the candidate values d·c·sign(ideal) and the change v − them."""
        cand = d[:, None] * tl.load(c_ptr) * tl.where(ideal < 0, -1.0, 1.0)[:, None]
        return v[:, None] - cand, cand

    @triton.jit
    def _window_kernel(grad_ptr, h_ptr, hinv_ptr, val_ptr, db_ptr, index_ptr, signs_ptr, gridt_ptr, grid_ptr,
                       pend_ptr, R, n, w0, width, h_expert_stride, hinv_expert_stride, pend_stride,
                       K: tl.constexpr, ROWS: tl.constexpr, W: tl.constexpr, CHUNK: tl.constexpr,
                       ENTRIES: tl.constexpr):
        e = tl.program_id(0)
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        rm = rows < R
        lane = tl.arange(0, 8)
        slot = tl.arange(0, K)
        ent = tl.arange(0, CHUNK)
        grp = tl.arange(0, W // 8)
        row = (e * R + rows).to(tl.int64)
        # the window's gradient as (rows, groups, 8): a group's 8 columns are one reduction over the middle axis
        offs = grp[:, None] * 8 + lane[None, :]                                                 # (W / 8, 8)
        cm = offs < width
        tile = rm[:, None, None] & cm[None, :, :]
        at = row * n + w0                                   # (E, rows, n) tensors: this window's first column
        gw = tl.load(grad_ptr + at[:, None, None] + offs[None, :, :], mask=tile, other=0.0)
        hb = h_ptr + e.to(tl.int64) * h_expert_stride
        groups = n // 8
        never = 0x7FFFFFFFFFFFFFFF                          # above every real key
        for gi in range(width // 8):
            c0 = w0 + 8 * gi                                # the group's first column
            gidx = row * groups + c0 // 8                   # (E, rows, groups) tensors
            vp = val_ptr + row * n + c0
            hg = hb + c0.to(tl.int64) * (n + 1)             # H_BB's first entry; rows n apart
            hi = hinv_ptr + e.to(tl.int64) * hinv_expert_stride + (c0 // 8) * 64
            gb = tl.sum(tl.where((grp == gi)[None, :, None], gw, 0.0), axis=1)                 # (ROWS, 8)
            # per weight i: the gradient, the current value and the unconstrained best value v + (g_B·H_BB⁻¹)_i
            b0, b1, b2, b3 = _column(gb, lane, 0), _column(gb, lane, 1), _column(gb, lane, 2), _column(gb, lane, 3)
            b4, b5, b6, b7 = _column(gb, lane, 4), _column(gb, lane, 5), _column(gb, lane, 6), _column(gb, lane, 7)
            v0, v1, v2, v3, v4, v5, v6, v7 = load8(vp, rm)
            t0 = v0 + _dot8(hi + 0, b0, b1, b2, b3, b4, b5, b6, b7)     # H_BB⁻¹ is symmetric: row i is column i
            t1 = v1 + _dot8(hi + 8, b0, b1, b2, b3, b4, b5, b6, b7)
            t2 = v2 + _dot8(hi + 16, b0, b1, b2, b3, b4, b5, b6, b7)
            t3 = v3 + _dot8(hi + 24, b0, b1, b2, b3, b4, b5, b6, b7)
            t4 = v4 + _dot8(hi + 32, b0, b1, b2, b3, b4, b5, b6, b7)
            t5 = v5 + _dot8(hi + 40, b0, b1, b2, b3, b4, b5, b6, b7)
            t6 = v6 + _dot8(hi + 48, b0, b1, b2, b3, b4, b5, b6, b7)
            t7 = v7 + _dot8(hi + 56, b0, b1, b2, b3, b4, b5, b6, b7)
            # the diagonal metric diag(H_BB)
            m0 = tl.load(hg)
            m1 = tl.load(hg + (n + 1))
            m2 = tl.load(hg + 2 * (n + 1))
            m3 = tl.load(hg + 3 * (n + 1))
            m4 = tl.load(hg + 4 * (n + 1))
            m5 = tl.load(hg + 5 * (n + 1))
            m6 = tl.load(hg + 6 * (n + 1))
            m7 = tl.load(hg + 7 * (n + 1))
            a0, a1, a2, a3 = m0 * tl.abs(t0), m1 * tl.abs(t1), m2 * tl.abs(t2), m3 * tl.abs(t3)
            a4, a5, a6, a7 = m4 * tl.abs(t4), m5 * tl.abs(t5), m6 * tl.abs(t6), m7 * tl.abs(t7)
            d = tl.load(db_ptr + gidx, mask=rm, other=0.0)
            ss = d * d
            d2 = 2.0 * d
            # the K best keys so far; distinct placeholders above every real key are evicted first
            best = tl.zeros([ROWS, K], tl.int64) + (never - 1 - slot[None, :])
            worst = tl.max(best, axis=1)
            for k0 in range(0, ENTRIES, CHUNK):
                idx = k0 + ent
                gt = gridt_ptr + idx                        # the codebook transposed (8, ENTRIES): coalesced
                q0 = tl.load(gt + 0 * ENTRIES)
                q1 = tl.load(gt + 1 * ENTRIES)
                q2 = tl.load(gt + 2 * ENTRIES)
                q3 = tl.load(gt + 3 * ENTRIES)
                q4 = tl.load(gt + 4 * ENTRIES)
                q5 = tl.load(gt + 5 * ENTRIES)
                q6 = tl.load(gt + 6 * ENTRIES)
                q7 = tl.load(gt + 7 * ENTRIES)
                c2m = m0 * q0 * q0 + m1 * q1 * q1 + m2 * q2 * q2 + m3 * q3 * q3 \
                    + m4 * q4 * q4 + m5 * q5 * q5 + m6 * q6 * q6 + m7 * q7 * q7                   # (CHUNK,)
                y = a0[:, None] * q0[None, :] + a1[:, None] * q1[None, :] + a2[:, None] * q2[None, :] \
                    + a3[:, None] * q3[None, :] + a4[:, None] * q4[None, :] + a5[:, None] * q5[None, :] \
                    + a6[:, None] * q6[None, :] + a7[:, None] * q7[None, :]
                key = _sort_key(ss[:, None] * c2m[None, :] - d2[:, None] * y, idx[None, :])     # (ROWS, CHUNK)
                # the chunk's K best in ascending order, each replacing the list's worst where it is smaller
                for _ in tl.static_range(K):
                    low = tl.min(key, axis=1)
                    key = tl.where(key == low[:, None], never, key)
                    best = tl.where((low < worst)[:, None] & (best == worst[:, None]), low[:, None], best)
                    worst = tl.max(best, axis=1)
            # the shortlist (rows, K) scored with the exact change of the quadratic, 2δ·g_B + δ·H_BB·δ, one tile per
            # weight; the lowest key wins a tie, as argmin over the ascending shortlist does
            cp = grid_ptr + (best & 0xFFFFFFFF) * 8
            dx0, cv0 = _weight(v0, d, cp + 0, t0)
            dx1, cv1 = _weight(v1, d, cp + 1, t1)
            dx2, cv2 = _weight(v2, d, cp + 2, t2)
            dx3, cv3 = _weight(v3, d, cp + 3, t3)
            dx4, cv4 = _weight(v4, d, cp + 4, t4)
            dx5, cv5 = _weight(v5, d, cp + 5, t5)
            dx6, cv6 = _weight(v6, d, cp + 6, t6)
            dx7, cv7 = _weight(v7, d, cp + 7, t7)
            lin = dx0 * b0[:, None] + dx1 * b1[:, None] + dx2 * b2[:, None] + dx3 * b3[:, None] \
                + dx4 * b4[:, None] + dx5 * b5[:, None] + dx6 * b6[:, None] + dx7 * b7[:, None]
            quad = dx0 * _dot8(hg, dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7) \
                + dx1 * _dot8(hg + n, dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7) \
                + dx2 * _dot8(hg + 2 * n, dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7) \
                + dx3 * _dot8(hg + 3 * n, dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7) \
                + dx4 * _dot8(hg + 4 * n, dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7) \
                + dx5 * _dot8(hg + 5 * n, dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7) \
                + dx6 * _dot8(hg + 6 * n, dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7) \
                + dx7 * _dot8(hg + 7 * n, dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7)
            dl = 2.0 * lin + quad                                                              # (ROWS, K)
            low = tl.min(dl, axis=1)
            pick = tl.min(tl.where(dl == low[:, None], best, never), axis=1)
            sel = best == pick[:, None]
            take = (low < 0) & rm
            # the change of W − Ŵ per weight (zero where the group keeps its entry), the new values stored
            st0 = tl.where(take, v0 - tl.sum(tl.where(sel, cv0, 0.0), axis=1), 0.0)
            st1 = tl.where(take, v1 - tl.sum(tl.where(sel, cv1, 0.0), axis=1), 0.0)
            st2 = tl.where(take, v2 - tl.sum(tl.where(sel, cv2, 0.0), axis=1), 0.0)
            st3 = tl.where(take, v3 - tl.sum(tl.where(sel, cv3, 0.0), axis=1), 0.0)
            st4 = tl.where(take, v4 - tl.sum(tl.where(sel, cv4, 0.0), axis=1), 0.0)
            st5 = tl.where(take, v5 - tl.sum(tl.where(sel, cv5, 0.0), axis=1), 0.0)
            st6 = tl.where(take, v6 - tl.sum(tl.where(sel, cv6, 0.0), axis=1), 0.0)
            st7 = tl.where(take, v7 - tl.sum(tl.where(sel, cv7, 0.0), axis=1), 0.0)
            tl.store(vp + 0, tl.where(take, tl.sum(tl.where(sel, cv0, 0.0), axis=1), v0), mask=rm)
            tl.store(vp + 1, tl.where(take, tl.sum(tl.where(sel, cv1, 0.0), axis=1), v1), mask=rm)
            tl.store(vp + 2, tl.where(take, tl.sum(tl.where(sel, cv2, 0.0), axis=1), v2), mask=rm)
            tl.store(vp + 3, tl.where(take, tl.sum(tl.where(sel, cv3, 0.0), axis=1), v3), mask=rm)
            tl.store(vp + 4, tl.where(take, tl.sum(tl.where(sel, cv4, 0.0), axis=1), v4), mask=rm)
            tl.store(vp + 5, tl.where(take, tl.sum(tl.where(sel, cv5, 0.0), axis=1), v5), mask=rm)
            tl.store(vp + 6, tl.where(take, tl.sum(tl.where(sel, cv6, 0.0), axis=1), v6), mask=rm)
            tl.store(vp + 7, tl.where(take, tl.sum(tl.where(sel, cv7, 0.0), axis=1), v7), mask=rm)
            bits = tl.where(t0 < 0, 1, 0) + tl.where(t1 < 0, 2, 0) + tl.where(t2 < 0, 4, 0) \
                + tl.where(t3 < 0, 8, 0) + tl.where(t4 < 0, 16, 0) + tl.where(t5 < 0, 32, 0) \
                + tl.where(t6 < 0, 64, 0) + tl.where(t7 < 0, 128, 0)
            old_id = tl.load(index_ptr + gidx, mask=rm, other=0)
            old_bits = tl.load(signs_ptr + gidx, mask=rm, other=0)
            tl.store(index_ptr + gidx, tl.where(take, pick & 0xFFFFFFFF, old_id), mask=rm)
            tl.store(signs_ptr + gidx, tl.where(take, bits.to(tl.int64), old_bits), mask=rm)
            # the gradient of the window's columns gets step ⊗ H[group, window]; pending the step itself
            hw = hb + c0.to(tl.int64) * n + w0 + offs[None, :, :]
            gw = gw + st0[:, None, None] * tl.load(hw, mask=cm[None, :, :], other=0.0)
            gw = gw + st1[:, None, None] * tl.load(hw + n, mask=cm[None, :, :], other=0.0)
            gw = gw + st2[:, None, None] * tl.load(hw + 2 * n, mask=cm[None, :, :], other=0.0)
            gw = gw + st3[:, None, None] * tl.load(hw + 3 * n, mask=cm[None, :, :], other=0.0)
            gw = gw + st4[:, None, None] * tl.load(hw + 4 * n, mask=cm[None, :, :], other=0.0)
            gw = gw + st5[:, None, None] * tl.load(hw + 5 * n, mask=cm[None, :, :], other=0.0)
            gw = gw + st6[:, None, None] * tl.load(hw + 6 * n, mask=cm[None, :, :], other=0.0)
            gw = gw + st7[:, None, None] * tl.load(hw + 7 * n, mask=cm[None, :, :], other=0.0)
            pp = pend_ptr + row * pend_stride + 8 * gi
            tl.store(pp + 0, 0.0 + st0, mask=rm)
            tl.store(pp + 1, 0.0 + st1, mask=rm)
            tl.store(pp + 2, 0.0 + st2, mask=rm)
            tl.store(pp + 3, 0.0 + st3, mask=rm)
            tl.store(pp + 4, 0.0 + st4, mask=rm)
            tl.store(pp + 5, 0.0 + st5, mask=rm)
            tl.store(pp + 6, 0.0 + st6, mask=rm)
            tl.store(pp + 7, 0.0 + st7, mask=rm)
        tl.store(grad_ptr + at[:, None, None] + offs[None, :, :], gw, mask=tile)


def group_inverses(hbb: torch.Tensor) -> torch.Tensor:
    """(E|1, groups, 8, 8) float32 inverses of H's 8 x 8 diagonal blocks `hbb` (E|1, groups, 8, 8), positive
    definite, made in float64 and symmetrised, for :func:`iq2s_window`."""
    inv = torch.linalg.inv_ex(hbb.to(torch.float64))[0]
    return (0.5 * (inv + inv.transpose(-1, -2))).to(torch.float32).contiguous()


def iq2s_window(grad: torch.Tensor, hessian: torch.Tensor, hinv: torch.Tensor, val: torch.Tensor,
                db: torch.Tensor, index: torch.Tensor, signs: torch.Tensor, grid: torch.Tensor, grid_t: torch.Tensor,
                pending: torch.Tensor, w0: int, width: int, k: int) -> None:
    """One window's group descent, in place: `grad` (the gradient) and `val` (decoded values) float32 (E, rows, n),
    `db` float32 / `index`, `signs` int64 (E, rows, groups), all contiguous; `hessian` (E|1, n, n) and `hinv`
    (:func:`group_inverses`) contiguous; `grid` (1024, 8) and `grid_t` (8, 1024) the codebook; columns
    w0 .. w0 + width (multiples of 8); `pending` (E, rows, >= width), contiguous, receives each group's change of
    W − Ŵ; k (a power of two) entries shortlisted per group."""
    E, R, n = grad.shape
    W = triton.next_power_of_2(width)  # the tile's width
    h_stride = 0 if hessian.shape[0] == 1 else n * n
    hinv_stride = 0 if hinv.shape[0] == 1 else n * 8
    _window_kernel[(E, triton.cdiv(R, ROWS))](grad, hessian, hinv, val, db, index, signs, grid_t, grid, pending,
                                              R, n, w0, width, h_stride, hinv_stride, pending.shape[-1], K=k,
                                              ROWS=ROWS, W=W, CHUNK=CHUNK, ENTRIES=ENTRIES,
                                              **launch_opts(grad.device, WARPS))
