"""Fused Triton kernel for the lattice-codebook search of the i-quants (IQ2_XXS/XS/S, IQ3_XXS/S), bit-exact.

One lane per sub-block runs :func:`i_quants.torch_grid.search` (ggml's loop, documented in
:mod:`numpy_iq2`) in registers: for every candidate scale it rounds each group of levels, looks the
code up in the codebook map and, off the codebook, scans that code's neighbour list for the entry with
the least weighted error (the lane loops to the longest list in its program, masked); the fit sums run
over the sub-block's elements in order, the candidates compete in ggml's order, and the winner's
levels are stored as they win. The refinement pass re-rounds with the best scale. Exactness rules are
those of :mod:`triton_kernels.search` (no FMA, ``div_rn``, the bit-trick rounding); used only where its
self-check passes (:func:`triton_kernels.search.fused_ok`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from mixq.quant.ggml.i_quants import numpy_iq2
from mixq.quant.ggml.triton_kernels.search import launch_opts, triton, tl

F32 = torch.float32
# sub-blocks per program: the neighbour scan runs to the longest list among a program's lanes, so
# programs are kept small (2 warps) to waste less on lanes that finished early
LANES = 64
_REFINE = {"offgrid": 0, "all_if_offgrid": 1, "all": 2}


@dataclass(frozen=True)
class GridTables:
    """A codebook's tables as int32 tensors on one device, for the kernel."""
    kmap: torch.Tensor      # (codes,) entry index or -1
    nb_row: torch.Tensor    # (codes,) neighbour-list row or -1
    nb_len: torch.Tensor    # (rows,)
    nb: torch.Tensor        # (rows, maxlen) entries in ggml's order, -1 padded
    codes: torch.Tensor     # (entries,) packed level code of each entry
    maxlen: int


@lru_cache(maxsize=None)
def grid_tables(qtype: str, device: str) -> GridTables:
    """Tables of ``qtype``'s codebook (from :func:`numpy_iq2.codebook`) on ``device``."""
    cb = numpy_iq2.codebook(qtype)
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a)).to(device=device, dtype=torch.int32)
    codes = (cb.levels << cb.shifts[None]).sum(1)
    return GridTables(t(cb.kmap), t(cb.nb_row), t(cb.nb_len), t(cb.nb), t(codes), int(cb.nb.shape[1]))


if triton is not None:
    from mixq.quant.ggml.triton_kernels.search import nearest_int_bits

    @triton.jit
    def _group_levels_code(x_ptr, lane, m, B, g0, idv, GROUP: tl.constexpr, BITS: tl.constexpr,
                           NLEV: tl.constexpr):
        """Packed code of clamp(nearest_int(0.5*(idv*x - 1)), 0, NLEV-1) over the group's elements."""
        code = tl.zeros(idv.shape, tl.int32)
        for j in tl.static_range(GROUP):
            xj = tl.load(x_ptr + (g0 + j) * B + lane, mask=m, other=0.0)
            lv = nearest_int_bits((idv * xj - 1.0) * 0.5)
            lv = tl.minimum(tl.maximum(lv, 0), NLEV - 1)
            code = code | (lv << (BITS * j))
        return code

    @triton.jit
    def _best_neighbour(x_ptr, wa_ptr, lane, m, B, g0, sc, code, need, nb_row_ptr, nb_len_ptr, nb_ptr, gcode_ptr,
                        MAXLEN: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr):
        """Code of the neighbour of ``code`` with the least sum_i wa_i (sc*q_i - x_i)^2 (first one on ties,
        NaN first as torch's argmin), for the lanes that ``need`` it; others get ``code`` back."""
        row = tl.load(nb_row_ptr + code, mask=need, other=0)
        row = tl.where(need, row, 0)
        n = tl.where(need, tl.load(nb_len_ptr + row, mask=need, other=0), 0)
        best_d2 = tl.full(sc.shape, float("inf"), tl.float32)
        best = tl.load(nb_ptr + row * MAXLEN, mask=need, other=0)
        top = tl.max(n, axis=0)
        k = top - top  # an int32 tensor: a loop-carried variable keeps its type
        while k < top:  # to the longest list among the lanes (a while: the interpreter's range wants an int)
            ok = need & (k < n)
            e = tl.load(nb_ptr + row * MAXLEN + k, mask=ok, other=0)
            ecode = tl.load(gcode_ptr + e, mask=ok, other=0)
            d2 = tl.zeros(sc.shape, tl.float32)
            for j in tl.static_range(GROUP):
                xj = tl.load(x_ptr + (g0 + j) * B + lane, mask=m, other=0.0)
                wj = tl.load(wa_ptr + (g0 + j) * B + lane, mask=m, other=0.0)
                q = (((ecode >> (BITS * j)) & ((1 << BITS) - 1)) * 2 + 1).to(tl.float32)
                diff = sc * q - xj
                d2 = d2 + wj * diff * diff
            win = ok & ((d2 < best_d2) | ((d2 != d2) & (best_d2 == best_d2)))
            best_d2 = tl.where(win, d2, best_d2)
            best = tl.where(win, e, best)
            k += 1
        bcode = tl.load(gcode_ptr + best, mask=need, other=0)
        return tl.where(need, bcode, code)

    @triton.jit
    def _fit(x_ptr, w_ptr, codes_ptr, lane, m, B, GROUP: tl.constexpr, BITS: tl.constexpr, NG: tl.constexpr):
        """(sum w*x*q, sum w*q*q), q = 2L+1, over the sub-block's elements in order; levels from the group
        codes stored at codes_ptr (NG, B)."""
        sumqx = tl.zeros(lane.shape, tl.float32)
        sumq2 = tl.zeros(lane.shape, tl.float32)
        for k in tl.static_range(NG):
            code = tl.load(codes_ptr + k * B + lane, mask=m, other=0)
            for j in tl.static_range(GROUP):
                i = k * GROUP + j
                xi = tl.load(x_ptr + i * B + lane, mask=m, other=0.0)
                wi = tl.load(w_ptr + i * B + lane, mask=m, other=0.0)
                q = (((code >> (BITS * j)) & ((1 << BITS) - 1)) * 2 + 1).to(tl.float32)
                sumqx = sumqx + wi * xi * q
                sumq2 = sumq2 + wi * q * q
        return sumqx, sumq2

    def _search_src(x_ptr, w_ptr, wa_ptr, base_ptr, scale0_ptr, num_ptr, kmap_ptr, nb_row_ptr, nb_len_ptr, nb_ptr,
                    gcode_ptr, tmp_ptr, win_ptr, on_ptr, scale_ptr, B,
                    NCAND: tl.constexpr, M: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
                    NLEV: tl.constexpr, MAXLEN: tl.constexpr, REFINE: tl.constexpr, ON_INIT: tl.constexpr,
                    LANES: tl.constexpr):
        """The i-quant sub-block search; per lane: x=|x|, w, wa=sqrt(w) (M, B); base, scale0 (B,).
        Scratch tmp (NG, B) candidate codes; outputs win (NG, B) winning codes, on (NG, B), scale (B,)."""
        NG: tl.constexpr = M // GROUP
        lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
        m = lane < B
        base = tl.load(base_ptr + lane, mask=m, other=1.0)
        scale = tl.load(scale0_ptr + lane, mask=m, other=0.0)
        best = tl.zeros([LANES], tl.float32)
        any_off = lane < 0
        for k in tl.static_range(NG):
            tl.store(win_ptr + k * B + lane, tl.zeros([LANES], tl.int32), mask=m)
            tl.store(on_ptr + k * B + lane, tl.full([LANES], ON_INIT, tl.int8), mask=m)
        for s in range(NCAND):
            idv = tl.math.div_rn(tl.zeros([LANES], tl.float32) + tl.load(num_ptr + s), base)
            this_scale = tl.math.div_rn(tl.full([LANES], 1.0, tl.float32), idv)
            off_bits = tl.zeros([LANES], tl.int32)
            for k in tl.static_range(NG):
                code = _group_levels_code(x_ptr, lane, m, B, k * GROUP, idv, GROUP, BITS, NLEV)
                off = m & (tl.load(kmap_ptr + code, mask=m, other=0) < 0)
                code = _best_neighbour(x_ptr, wa_ptr, lane, m, B, k * GROUP, this_scale, code, off, nb_row_ptr,
                                       nb_len_ptr, nb_ptr, gcode_ptr, MAXLEN, GROUP, BITS)
                tl.store(tmp_ptr + k * B + lane, code, mask=m)
                off_bits = off_bits | (off.to(tl.int32) << k)
            sumqx, sumq2 = _fit(x_ptr, w_ptr, tmp_ptr, lane, m, B, GROUP, BITS, NG)
            better = m & (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            scale = tl.where(better, tl.math.div_rn(sumqx, tl.where(better, sumq2, 1.0)), scale)
            best = tl.where(better, scale * sumqx, best)
            for k in tl.static_range(NG):
                code = tl.load(tmp_ptr + k * B + lane, mask=m, other=0)
                tl.store(win_ptr + k * B + lane, code, mask=better)
                tl.store(on_ptr + k * B + lane, (((off_bits >> k) & 1) == 0).to(tl.int8), mask=better)
        # refinement with the best scale
        for k in tl.static_range(NG):
            any_off = any_off | (tl.load(on_ptr + k * B + lane, mask=m, other=1) == 0)
        pos = scale > 0
        idr = tl.math.div_rn(tl.full([LANES], 1.0, tl.float32), tl.where(pos, scale, 1.0))
        any_redo = lane < 0
        for k in tl.static_range(NG):
            on_k = tl.load(on_ptr + k * B + lane, mask=m, other=1) != 0
            if REFINE == 0:
                redo = ~on_k
            elif REFINE == 1:
                redo = any_off
            else:
                redo = lane >= 0
            redo = m & redo & pos
            any_redo = any_redo | redo
            code = _group_levels_code(x_ptr, lane, m, B, k * GROUP, idr, GROUP, BITS, NLEV)
            off = redo & (tl.load(kmap_ptr + code, mask=m, other=0) < 0)
            code = _best_neighbour(x_ptr, wa_ptr, lane, m, B, k * GROUP, scale, code, off, nb_row_ptr, nb_len_ptr,
                                   nb_ptr, gcode_ptr, MAXLEN, GROUP, BITS)
            tl.store(win_ptr + k * B + lane, code, mask=redo)
        sumqx, sumq2 = _fit(x_ptr, w_ptr, win_ptr, lane, m, B, GROUP, BITS, NG)
        upd = any_redo & (sumq2 > 0)
        scale = tl.where(upd, tl.math.div_rn(sumqx, tl.where(upd, sumq2, 1.0)), scale)
        tl.store(scale_ptr + lane, scale, mask=m)


@lru_cache(maxsize=None)
def _kernel():
    return triton.jit(_search_src)


def search(qtype: str, xval: torch.Tensor, w: torch.Tensor, waux: torch.Tensor, base: torch.Tensor,
           scale: torch.Tensor, steps: int, step: float, refine: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused :func:`i_quants.torch_grid.search`: same arguments (plus the type), same (scale, L (ng, group, B))."""
    cb = numpy_iq2.codebook(qtype)
    tables = grid_tables(qtype, str(xval.device))
    M, B = xval.shape
    group, bits, nlev = cb.group, int(cb.shifts[1]), cb.nlev
    ng = M // group
    top = float(2 * nlev - 1)
    nums = [float(torch.tensor(top) + torch.tensor(float(s)) * torch.tensor(step)) for s in range(-steps, steps + 1)]
    num = torch.tensor(nums, dtype=F32, device=xval.device)
    dev = xval.device
    tmp = torch.empty((ng, B), dtype=torch.int32, device=dev)
    win = torch.empty((ng, B), dtype=torch.int32, device=dev)
    on = torch.empty((ng, B), dtype=torch.int8, device=dev)
    out_scale = torch.empty(B, dtype=F32, device=dev)
    _kernel()[(triton.cdiv(B, LANES),)](
        xval.contiguous(), w.contiguous(), waux.contiguous(), base.contiguous(), scale.contiguous(), num,
        tables.kmap, tables.nb_row, tables.nb_len, tables.nb, tables.codes, tmp, win, on, out_scale, B,
        NCAND=len(nums), M=M, GROUP=group, BITS=bits, NLEV=nlev, MAXLEN=tables.maxlen, REFINE=_REFINE[refine],
        ON_INIT=int(refine != "all_if_offgrid"), LANES=LANES, **launch_opts(dev, num_warps=2))
    shifts = torch.as_tensor(cb.shifts, device=dev, dtype=torch.int32)
    L = (win[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)   # (ng, group, B)
    return out_scale, L
