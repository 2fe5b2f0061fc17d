"""The lattice-codebook search of ggml's i-quants (IQ2_XXS/XS/S, IQ3_XXS/S) in torch, bit-exact on any device.

Same search as :mod:`numpy_iq2` (which documents it), vectorised for accelerators: every candidate
scale of every sub-block is rounded at once, every off-codebook group of every candidate is snapped
to its best neighbour at once (neighbour lists padded per width bin), and the candidates are then
compared in ggml's order. Sub-block arrays are (element, sub-block) so that sums run in ggml's
float32 order (:mod:`torch_search`). The codebook tables come from :func:`numpy_iq2.codebook`
(derived from gguf-py's grids) and are copied once per device.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from mixq.errors import InputError
from mixq.quant.ggml.triton_kernels import search as triton_search
from mixq.quant.ggml.triton_kernels import grid as triton_grid
from mixq.quant.ggml.i_quants import numpy_iq2
from mixq.quant.ggml.k_quants.torch_search import F32, div_by, fp16_bits, nearest_int, rdiv, seq_sum, sqrt

# neighbour-list width bins: each bin pads its groups only up to the longest list in it
_WIDTHS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 1 << 30)
# neighbour slots (groups x padded width) searched per batch: bounds the gathered tables' memory
SLOTS_PER_BATCH = 1 << 23


@dataclass(frozen=True)
class DeviceCodebook:
    """A codebook's search tables (see :class:`numpy_iq2.Codebook`) as tensors on one device."""
    qtype: str
    group: int
    nlev: int
    head: int
    shifts: torch.Tensor    # (group,) int32
    levels: torch.Tensor    # (N, group) int32
    values: torch.Tensor    # (nlev,) float32: 2l+1
    kmap: torch.Tensor      # (codes,) int64: entry index or -1
    nb_row: torch.Tensor    # (codes,) int64: row of the neighbour tables or -1
    nb_len: torch.Tensor    # (rows,) int64: neighbours per row
    # (rows, maxlen, 2 + group - head) int64, per neighbour: entry index (-1 padding), index into the
    # head partial-sum table, indices of its remaining levels into the flat (group, nlev) terms
    nb_table: torch.Tensor


@lru_cache(maxsize=None)
def device_codebook(qtype: str, device: str) -> DeviceCodebook:
    """The tables of ``qtype``'s codebook on ``device`` (built once per process and device)."""
    cb = numpy_iq2.codebook(qtype)
    t = lambda a, dt=torch.int64: torch.as_tensor(a).to(device=device, dtype=dt)
    table = np.concatenate([cb.nb[:, :, None], cb.nb_head[:, :, None], cb.nb_tail.transpose(1, 2, 0)], axis=2)
    return DeviceCodebook(qtype, cb.group, cb.nlev, cb.head, t(cb.shifts, torch.int32), t(cb.levels, torch.int32),
                          t(cb.values, F32), t(cb.kmap), t(cb.nb_row), t(cb.nb_len), t(table))


def codes_of(cb: DeviceCodebook, L: torch.Tensor) -> torch.Tensor:
    """Packed level codes of groups L (..., group, B) -> (..., B) int64 (disjoint bits: sum is OR)."""
    return (L.to(torch.int64) << cb.shifts.to(torch.int64)[:, None]).sum(-2)


def round_levels(idv: torch.Tensor, xval: torch.Tensor, nlev: int) -> torch.Tensor:
    """ggml's level rounding clamp(nearest_int(0.5*(id*x - 1)), 0, nlev-1), int32."""
    return torch.clamp(nearest_int((idv * xval - 1.0) * 0.5), 0, nlev - 1)


def nearest_entry(cb: DeviceCodebook, rows: torch.Tensor, xv: torch.Tensor, wa: torch.Tensor, sc: torch.Tensor,
                  width: int, values: torch.Tensor | None = None) -> torch.Tensor:
    """Codebook entry minimising sum_i wa_i (sc*p_i - x_i)^2 over each row's neighbour list.

    rows (n,) neighbour-table rows, xv/wa (n, group), sc (n,); p_i is the value of the entry's level i:
    ``values`` (n, nlev) per row, else the codebook's 2l+1. Sums run over the entry's elements in
    order and ties go to the earlier neighbour (ggml's strict '<'). Each term takes one of nlev values
    per element: the terms are computed once per group, the running sums over the first `head`
    elements once per level combination, and each neighbour gathers its prefix and adds its
    remaining terms in order (the same float32 operations as ggml's loop).
    """
    n = rows.shape[0]
    table = cb.nb_table[:, :width].index_select(0, rows)           # (n, width, 2 + tails)
    cand = table[:, :, 0]
    vals = cb.values if values is None else values[:, None, :]
    diff = sc[:, None, None] * vals - xv[:, :, None]                 # (n, group, nlev)
    terms = wa[:, :, None] * diff * diff
    part = terms[:, 0]
    for i in range(1, cb.head):
        part = (part[:, :, None] + terms[:, i][:, None, :]).reshape(n, -1)
    d2 = torch.gather(part, 1, table[:, :, 1])
    flat = terms.reshape(n, -1)
    for j in range(2, table.shape[2]):
        d2 = d2 + torch.gather(flat, 1, table[:, :, j])
    d2 = torch.where(cand < 0, float("inf"), d2)
    return torch.gather(cand, 1, torch.argmin(d2, dim=1, keepdim=True))[:, 0]


def nearest_binned(cb: DeviceCodebook, rows: torch.Tensor, xv: torch.Tensor, wa: torch.Tensor, sc: torch.Tensor,
                   values: torch.Tensor | None = None, *, widths: tuple[int, ...] = _WIDTHS,
                   slots: int = SLOTS_PER_BATCH) -> torch.Tensor:
    """``nearest_entry`` of every group, the groups binned by the length of their neighbour list so that each
    call pads only up to its bin's longest list, at most ``slots`` candidate slots a call (memory, not results:
    every group's choice is its own)."""
    lens = cb.nb_len[rows]
    best = torch.empty_like(rows)
    lo = 0
    for hi in widths:
        part = torch.nonzero((lens > lo) & (lens <= hi), as_tuple=True)[0]
        lo = hi
        if part.numel():
            width = int(lens[part].max())
            step = max(1, slots // width)
            for p0 in range(0, part.numel(), step):
                q = part[p0:p0 + step]
                best[q] = nearest_entry(cb, rows[q], xv[q], wa[q], sc[q], width,
                                        None if values is None else values[q])
    return best


def snap(cb: DeviceCodebook, L: torch.Tensor, xg: torch.Tensor, wg: torch.Tensor, scale: torch.Tensor,
         active: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace every active group of levels that is off the codebook by its best neighbour.

    L (C, ng, group, B) levels of C candidates; xg, wg (ng, group, B) |x| and sqrt-weights;
    scale (C, B) the scale each candidate compares with; active (C, ng, B) or None for all.
    Returns (L with snapped groups, off-codebook mask (C, ng, B)).
    """
    codes = codes_of(cb, L)
    off = cb.kmap[codes] < 0
    sel = off if active is None else off & active
    c, k, b = torch.nonzero(sel, as_tuple=True)
    if c.numel() == 0:
        return L, off
    rows = cb.nb_row[codes[c, k, b]]
    G, B = xg.shape[0], xg.shape[2]
    flat_g = k * B + b                                               # group (k, b) in a (G*B, group) view
    xv = xg.permute(0, 2, 1).reshape(G * B, -1).index_select(0, flat_g)
    wa = wg.permute(0, 2, 1).reshape(G * B, -1).index_select(0, flat_g)
    sc = scale.reshape(-1).index_select(0, c * B + b)
    best = nearest_binned(cb, rows, xv, wa, sc)
    L = L.clone()
    L[c, k, :, b] = cb.levels[best]
    return L, off


def fit(wx: torch.Tensor, w: torch.Tensor, L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum w·x·q, sum w·q²) with q = 2L+1 over the m elements of each sub-block, in order.

    wx, w (m, B); L (C, m, B) -> each (C, B).
    """
    q = (2 * L + 1).to(F32).transpose(0, 1)
    return seq_sum(wx[:, None] * q), seq_sum(w[:, None] * q * q)


def prepare(xs: torch.Tensor, qw: torch.Tensor | None, m: int, sigma_factor: int, parity: bool,
            plain_weight: bool = False):
    """Sub-block views (m, B) of |x| (parity-fixed), weights, sqrt(weights) and sign bytes (m/8, B).

    Without importance the weight is x² (``plain_weight``, IQ3) or sigma²/4 + x² (IQ2_S). With
    ``parity`` an odd count of negative weights in a group of 8 flips the sign of the weight with the
    smallest w·x² (the first one on ties), as IQ2_XXS/XS and IQ3_XXS store 7 sign bits.
    """
    S = xs.shape[0]
    B = S * (256 // m)
    x = xs.reshape(B, m).T.contiguous()
    xt = xs.T.contiguous()
    sumx2 = seq_sum(xt * xt)
    sig = div_by(sumx2 * float(sigma_factor) if sigma_factor != 1 else sumx2, 256.0)
    sig = sig.repeat_interleave(256 // m)
    if qw is not None:
        w = qw.reshape(B, m).T * sqrt(sig + x * x)
    elif plain_weight:
        w = x * x
    else:
        w = sig * 0.25 + x * x
    waux = sqrt(w)
    neg = x < 0
    xval = torch.where(neg, -x, x)
    ng = m // 8
    neg = neg.reshape(ng, 8, B)
    if parity:
        odd = (neg.sum(1) % 2) == 1                                      # (ng, B)
        imin = torch.argmin((w * x * x).reshape(ng, 8, B), dim=1)        # first minimum, as ggml's scan
        flip = odd[:, None, :] & (torch.arange(8, device=xs.device)[None, :, None] == imin[:, None, :])
        xval = torch.where(flip.reshape(m, B), -xval, xval)
        neg = neg ^ flip
    signs = (neg.to(torch.int64) << torch.arange(8, device=xs.device)[None, :, None]).sum(1)
    if parity:
        signs = signs & 127
    return xval, w, waux, signs


def search(cb: DeviceCodebook, xval: torch.Tensor, w: torch.Tensor, waux: torch.Tensor, base: torch.Tensor,
           scale: torch.Tensor, steps: int, step: float, refine: str) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's sub-block search shared by the IQ2/IQ3 types. Returns (scale (B,), L (ng, group, B)).

    xval, w, waux: (m, B) sub-blocks; candidates id = (2*nlev-1 + s*step)/base for s in -steps..steps
    (``scale`` is the fallback when none fits). ``refine`` says which groups are re-rounded with the
    best scale afterwards: "offgrid" (groups whose best candidate needed a neighbour), "all_if_offgrid"
    (every group, when any did or none fitted) or "all".
    """
    rest = (steps, step, refine)
    if triton_search.use_fused(xval):
        def check() -> bool:
            c = [triton_search.check_columns(a) for a in (xval, w, waux)] + [base[:256], scale[:256]]
            return triton_search.same(triton_grid.search(cb.qtype, *c, *rest), search_eager(cb, *c, *rest))
        if triton_search.variant_ok(("grid", cb.qtype, *rest, str(xval.device)), check):
            return triton_grid.search(cb.qtype, xval, w, waux, base, scale, *rest)
    return search_eager(cb, xval, w, waux, base, scale, *rest)


def search_eager(cb: DeviceCodebook, xval: torch.Tensor, w: torch.Tensor, waux: torch.Tensor, base: torch.Tensor,
                 scale: torch.Tensor, steps: int, step: float, refine: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`search` in elementwise torch ops."""
    m, B = xval.shape
    ng = m // cb.group
    xg, wg = xval.reshape(ng, cb.group, B), waux.reshape(ng, cb.group, B)
    top = float(2 * cb.nlev - 1)
    ids = [float(torch.tensor(top) + torch.tensor(float(s)) * torch.tensor(step)) for s in range(-steps, steps + 1)]
    idv = torch.tensor(ids, dtype=F32, device=xval.device)[:, None] / base   # (C, B)
    C = idv.shape[0]
    Lc = round_levels(idv[:, None, :], xval, cb.nlev).reshape(C, ng, cb.group, B)
    Lc, off = snap(cb, Lc, xg, wg, rdiv(1.0, idv))
    wx = w * xval
    sumqx, sumq2 = fit(wx, w, Lc.reshape(C, m, B))
    # candidates compete in ggml's order: each must beat the best so far
    best = torch.zeros(B, dtype=F32, device=xval.device)
    win = torch.full((B,), -1, dtype=torch.int64, device=xval.device)
    for s in range(C):
        better = (sumq2[s] > 0) & (sumqx[s] * sumqx[s] > best * sumq2[s])
        scale = torch.where(better, sumqx[s] / torch.where(better, sumq2[s], 1.0), scale)
        best = torch.where(better, scale * sumqx[s], best)
        win = torch.where(better, s, win)
    found = win >= 0
    pick = win.clamp_min(0)
    bidx = torch.arange(B, device=xval.device)
    L = torch.where(found, Lc.permute(0, 3, 1, 2)[pick, bidx].permute(1, 2, 0), 0)   # (ng, group, B)
    on = torch.where(found, ~off.permute(0, 2, 1)[pick, bidx].T, refine != "all_if_offgrid")
    if refine == "offgrid":
        redo = ~on
    elif refine == "all_if_offgrid":
        redo = (~on).any(0, keepdim=True).expand(ng, B)
    else:
        redo = torch.ones_like(on)
    redo = redo & (scale > 0)
    rb = redo.any(0)
    idr = rdiv(1.0, torch.where(scale > 0, scale, 1.0))
    Lr = round_levels(idr, xval, cb.nlev).reshape(1, ng, cb.group, B)
    Lr, _ = snap(cb, Lr, xg, wg, scale[None], active=redo[None])
    L = torch.where(redo[:, None], Lr[0], L)
    sumqx, sumq2 = fit(wx, w, L.reshape(1, m, B))
    upd = rb & (sumq2[0] > 0)
    scale = torch.where(upd, sumqx[0] / torch.where(upd, sumq2[0], 1.0), scale)
    return scale, L


def finish(cb: DeviceCodebook, scale: torch.Tensor, L: torch.Tensor, zero: torch.Tensor, signs: torch.Tensor,
           S: int, nsub: int, sign_mask: int, d_factor: float | None = None):
    """Common tail: sign flip for negative scales, entry indices, super-block fp16 d and 4-bit scales.

    Returns (entry index (groups, B), signs (m/8, B), fp16 bits of d (S,), scale nibbles (S, nsub), dead (S,)).
    """
    negs = scale < 0
    scale = torch.where(negs, -scale, scale)
    signs = torch.where(negs, (~signs) & sign_mask, signs)
    scale = torch.where(zero, 0.0, scale)
    gi = cb.kmap[codes_of(cb, L)]
    gi = torch.where(zero, 0, gi)
    signs = torch.where(zero, 0, signs)
    if bool((gi < 0).any()):
        raise InputError("i-quant encoder: a group left the codebook (internal error)")
    sc = scale.reshape(S, nsub)
    max_scale = sc.amax(1)
    dead = max_scale == 0
    d = div_by(torch.where(dead, 1.0, max_scale), 31.0)
    h, _ = fp16_bits(d if d_factor is None else d * d_factor)
    h = torch.where(dead, 0, h)
    ls = torch.clamp(nearest_int((rdiv(1.0, d)[:, None] * sc - 1.0) * 0.5), 0, 15)
    ls = torch.where(dead[:, None], 0, ls)
    return gi, signs, h, ls, dead
