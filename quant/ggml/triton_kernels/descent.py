"""Fused Triton kernels for ggml's small-block searches with coordinate descent, and for sequential sums.

- :func:`seq_sum` - C's ``s = 0; for i: s += a[i]`` over dim 0 of (n, B), one lane per column (the eager
  loop launches one kernel per element: 256 for a super-block's sum of squares);
- :func:`qp_search` - make_qp_quants (the sub-block scales of the importance-weighted K-quants);
- :func:`q3_search` - make_q3_quants (Q3_K without importance).
Each lane keeps its block's levels in a (lanes, n) integer tile in registers (a column is read with an
exact integer masked sum); the descent always runs its 5 sweeps, which gives ggml's result (a sweep
that changes nothing in a block changes nothing later). Exactness rules: :mod:`triton_kernels.search`.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from mixq.quant.ggml.triton_kernels.search import LANES, launch_opts, triton, tl

F32 = torch.float32


if triton is not None:
    from mixq.quant.ggml.triton_kernels.search import nearest_int_bits

    @triton.jit
    def _col(tile, cols, i):
        """Column i of an integer (lanes, n) tile (exact: integer sum of one value and zeros)."""
        return tl.sum(tl.where(cols[None, :] == i, tile, 0), axis=1)

    @triton.jit
    def _descent(x_ptr, w_ptr, tile, cols, lane, m, B, sumlx, suml2, N: tl.constexpr, LO: tl.constexpr,
                 HI: tl.constexpr, QP: tl.constexpr):
        """ggml's coordinate descent: make_qp_quants (QP: levels <= HI, kept as uint8, weights w) or
        make_q3_quants (levels clamped to [LO, HI], weights x*x)."""
        for sweep in range(5):  # loops, not unrolled: unrolled, N = 32 took minutes to compile
            for i in range(N):
                xi = tl.load(x_ptr + i * B + lane, mask=m, other=0.0)
                if QP:
                    wi = tl.load(w_ptr + i * B + lane, mask=m, other=0.0)
                else:
                    wi = xi * xi
                li = _col(tile, cols, i)
                lf = li.to(tl.float32)
                slx = sumlx - wi * xi * lf
                sl2 = suml2 - wi * lf * lf
                new = tl.minimum(nearest_int_bits(tl.math.div_rn(xi * sl2, slx)), HI)
                if not QP:
                    new = tl.maximum(new, LO)
                nf = new.to(tl.float32)
                slx2 = slx + wi * xi * nf
                sl22 = sl2 + wi * nf * nf
                if QP:
                    gate = (slx > 0) & (sl2 > 0)
                    stored = new & 0xFF
                else:
                    gate = (slx > 0) & (sl22 > 0)
                    stored = new
                ok = gate & (new != li) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
                tile = tl.where((cols[None, :] == i) & ok[:, None], stored[:, None], tile)
                sumlx = tl.where(ok, slx2, sumlx)
                suml2 = tl.where(ok, sl22, suml2)
        return tile, sumlx, suml2

    def _seqsum_src(a_ptr, out_ptr, B, N: tl.constexpr, FROM_FIRST: tl.constexpr, LANES: tl.constexpr):
        lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
        m = lane < B
        s = tl.load(a_ptr + lane, mask=m, other=0.0)
        if not FROM_FIRST:
            s = s + 0.0
        for i in range(1, N):
            s = s + tl.load(a_ptr + i * B + lane, mask=m, other=0.0)
        tl.store(out_ptr + lane, s, mask=m)

    def _qp_src(x_ptr, w_ptr, num_ptr, scale_ptr, L_ptr, B, N: tl.constexpr, NP2: tl.constexpr, NMAX: tl.constexpr,
                EPS: tl.constexpr, LANES: tl.constexpr):
        """make_qp_quants per lane: x (non-negative values), w (N, B); num (8,) candidate numerators."""
        lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
        m = lane < B
        cols = tl.arange(0, NP2)
        mx = tl.zeros([LANES], tl.float32)
        for i in tl.static_range(N):
            xi = tl.load(x_ptr + i * B + lane, mask=m, other=0.0)
            mx = tl.where((xi > mx) | (xi != xi), xi, mx)   # NaN propagates, as torch's amax
        zero = mx < EPS
        mx = tl.where(zero, 1.0, mx)
        one = tl.full([LANES], 1.0, tl.float32)
        iscale = tl.math.div_rn(one * NMAX, mx)
        best = _qp_mse(x_ptr, w_ptr, lane, m, B, iscale, tl.math.div_rn(one, iscale), N, NMAX, True)
        for s in range(8):
            isc = tl.math.div_rn(one * tl.load(num_ptr + s), mx)
            cur = _qp_mse(x_ptr, w_ptr, lane, m, B, isc, tl.math.div_rn(one, isc), N, NMAX, False)
            better = cur < best
            best = tl.where(better, cur, best)
            iscale = tl.where(better, isc, iscale)
        tile = tl.zeros([LANES, NP2], tl.int32)
        sumlx = tl.zeros([LANES], tl.float32)
        suml2 = tl.zeros([LANES], tl.float32)
        for i in tl.static_range(N):
            xi = tl.load(x_ptr + i * B + lane, mask=m, other=0.0)
            wi = tl.load(w_ptr + i * B + lane, mask=m, other=0.0)
            lv = tl.minimum(nearest_int_bits(iscale * xi), NMAX)
            lf = lv.to(tl.float32)
            sumlx = sumlx + wi * xi * lf
            suml2 = suml2 + wi * lf * lf
            tile = tl.where(cols[None, :] == i, (lv & 0xFF)[:, None], tile)
        tile, sumlx, suml2 = _descent(x_ptr, w_ptr, tile, cols, lane, m, B, sumlx, suml2, N, 0, NMAX, True)
        scale = tl.where(suml2 > 0, tl.math.div_rn(sumlx, tl.where(suml2 > 0, suml2, 1.0)), 0.0)
        tl.store(scale_ptr + lane, tl.where(zero, 0.0, scale), mask=m)
        for i in tl.static_range(N):
            tl.store(L_ptr + i * B + lane, tl.where(zero, 0, _col(tile, cols, i)), mask=m)

    @triton.jit
    def _qp_mse(x_ptr, w_ptr, lane, m, B, isc, scale, N: tl.constexpr, NMAX: tl.constexpr, FIRST: tl.constexpr):
        """sum w*(x - scale*l)^2 over the block; l = nearest_int(isc*x) (as uint8 for the FIRST, else <= NMAX)."""
        mse = tl.zeros(isc.shape, tl.float32)
        for i in range(N):
            xi = tl.load(x_ptr + i * B + lane, mask=m, other=0.0)
            wi = tl.load(w_ptr + i * B + lane, mask=m, other=0.0)
            lv = nearest_int_bits(isc * xi)
            if FIRST:
                lv = lv & 0xFF
            else:
                lv = tl.minimum(lv, NMAX)
            diff = xi - scale * lv.to(tl.float32)
            mse = mse + wi * diff * diff
        return mse

    def _q3_src(x_ptr, scale_ptr, L_ptr, B, N: tl.constexpr, NP2: tl.constexpr, NMAX: tl.constexpr,
                EPS: tl.constexpr, LANES: tl.constexpr):
        """make_q3_quants (do_rmse) per lane: x (N, B), weights x*x."""
        lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
        m = lane < B
        cols = tl.arange(0, NP2)
        amax = tl.zeros([LANES], tl.float32)
        mx = tl.zeros([LANES], tl.float32)
        for i in tl.static_range(N):
            xi = tl.load(x_ptr + i * B + lane, mask=m, other=0.0)
            ax = tl.abs(xi)
            hit = ax > amax
            amax = tl.where(hit, ax, amax)
            mx = tl.where(hit, xi, mx)
        zero = amax < EPS
        mx = tl.where(zero, 1.0, mx)
        iscale = tl.math.div_rn(tl.full([LANES], -NMAX, tl.float32), mx)
        tile = tl.zeros([LANES, NP2], tl.int32)
        sumlx = tl.zeros([LANES], tl.float32)
        suml2 = tl.zeros([LANES], tl.float32)
        for i in tl.static_range(N):
            xi = tl.load(x_ptr + i * B + lane, mask=m, other=0.0)
            lv = tl.minimum(tl.maximum(nearest_int_bits(iscale * xi), -NMAX), NMAX - 1)
            lf = lv.to(tl.float32)
            wi = xi * xi
            sumlx = sumlx + wi * xi * lf
            suml2 = suml2 + wi * lf * lf
            tile = tl.where(cols[None, :] == i, lv[:, None], tile)
        tile, sumlx, suml2 = _descent(x_ptr, x_ptr, tile, cols, lane, m, B, sumlx, suml2, N, -NMAX, NMAX - 1, False)
        scale = tl.where(suml2 > 0, tl.math.div_rn(sumlx, tl.where(suml2 > 0, suml2, 1.0)), 0.0)
        tl.store(scale_ptr + lane, tl.where(zero, 0.0, scale), mask=m)
        for i in tl.static_range(N):
            tl.store(L_ptr + i * B + lane, tl.where(zero, 0, _col(tile, cols, i) + NMAX), mask=m)


@lru_cache(maxsize=None)
def _kernels():
    return triton.jit(_seqsum_src), triton.jit(_qp_src), triton.jit(_q3_src)


def _grid(B: int) -> tuple[int]:
    return (triton.cdiv(B, LANES),)


def seq_sum(a: torch.Tensor, from_first: bool = False) -> torch.Tensor:
    """Sequential float32 sum over dim 0 (seeded with +0 + a[0], or with a[0] itself)."""
    n, batch = a.shape[0], a.shape[1:]
    af = a.reshape(n, -1).contiguous()
    B = af.shape[1]
    out = torch.empty(B, dtype=F32, device=a.device)
    _kernels()[0][_grid(B)](af, out, B, N=n, FROM_FIRST=from_first, LANES=LANES, **launch_opts(a.device))
    return out.reshape(batch)


def qp_search(x: torch.Tensor, nmax: int, qw: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused make_qp_quants: x, qw (n, ...) -> (scale, L int32)."""
    n, batch = x.shape[0], x.shape[1:]
    xf, wf = x.reshape(n, -1).contiguous(), qw.reshape(n, -1).contiguous()
    B = xf.shape[1]
    f = lambda v: float(np.float32(v))
    num = torch.tensor([f(f(f(0.1) * f(s)) + f(nmax)) for s in range(-4, 5) if s != 0], dtype=F32, device=x.device)
    scale = torch.empty(B, dtype=F32, device=x.device)
    L = torch.empty((n, B), dtype=torch.int32, device=x.device)
    _kernels()[1][_grid(B)](xf, wf, num, scale, L, B, N=n, NP2=triton.next_power_of_2(n), NMAX=nmax, EPS=eps,
                            LANES=LANES, **launch_opts(x.device))
    return scale.reshape(batch), L.reshape(x.shape)


def q3_search(x: torch.Tensor, nmax: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused make_q3_quants: x (n, ...) -> (scale, L int32 in [0, 2*nmax))."""
    n, batch = x.shape[0], x.shape[1:]
    xf = x.reshape(n, -1).contiguous()
    B = xf.shape[1]
    scale = torch.empty(B, dtype=F32, device=x.device)
    L = torch.empty((n, B), dtype=torch.int32, device=x.device)
    _kernels()[2][_grid(B)](xf, scale, L, B, N=n, NP2=triton.next_power_of_2(n), NMAX=nmax, EPS=eps, LANES=LANES,
                            **launch_opts(x.device))
    return scale.reshape(batch), L.reshape(x.shape)
