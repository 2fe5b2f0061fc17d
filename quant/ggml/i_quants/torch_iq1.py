"""IQ1_S and IQ1_M encoders in torch, bit-exact with ggml on any device.

Both types store each group of 8 weights as one entry of a 2048-entry codebook of ternary 8-tuples
(levels l in {0, 1, 2} for -1, 0, +1), shifted by a stored ±delta: a weight decodes to
scale·(l - 1 ± 0.125). IQ1_S has 32-weight sub-blocks (one delta sign and a 3-bit scale each,
under an fp16 super-block scale); IQ1_M has 16-weight sub-blocks with a delta sign per group of 8
and the fp16 super-block scale spread over the top nibbles of its 3-bit scales.

ggml's search, reproduced here:

- per sub-block, sort the weights ascending (stably) and try every split of the sorted order into
  three runs (levels 0, 1, 2) with every delta sign choice, each scored by its weighted least-squares
  fit from prefix sums; the candidates compete in ggml's order (each must beat the best so far);
- a group whose levels are off the codebook is replaced by the entry of its neighbour list (the
  codebook's three nearest integer-distance shells, :func:`numpy_iq2.codebook`) with the smallest
  weighted squared error at the chosen scale; then the scale is refit;
- 3-bit sub-block scales relative to the super-block scale (IQ1_M refits that scale over the whole
  super-block).

Sub-block arrays are (element, sub-block) so that sums run in ggml's float32 order.
"""
from __future__ import annotations

import torch
from gguf import quants as gguf_quants

from mixq.errors import InputError
from mixq.quant.ggml.i_quants.torch_grid import device_codebook, nearest_binned
from mixq.quant.ggml.k_quants.torch_search import (F32, div_by, f32, fp16_bits, half_bytes, nearest_int, rdiv,
                                                   seq_sum, sqrt)

DELTA = f32(gguf_quants.IQ1_S.delta)   # the grid offset, the same for IQ1_M
GROUP_MAX_EPS_IQ1_S = f32(1e-12)
GROUP_MAX_EPS_IQ1_M = f32(1e-7)
D_FACTOR_IQ1_S = f32(1.125)
D_FACTOR_IQ1_M = f32(1.1125)
# the level values of a group with a + or - delta: (-1, 0, 1) + delta and (-1, 0, 1) - delta
_PLUS = (f32(-1 + DELTA), DELTA, f32(1 + DELTA))
_MINUS = (f32(-1 - DELTA), -DELTA, f32(1 - DELTA))
# neighbour slots searched per batch (bounds the gathered tables' memory)
SLOTS_PER_BATCH = 1 << 20
# neighbour-list width bins (the lists hold 12 to 205 entries)
_WIDTHS = (32, 64, 96, 128, 160, 1 << 30)


def _weights(x: torch.Tensor, qw: torch.Tensor | None, m: int) -> torch.Tensor:
    """ggml's per-weight importance (m, B) of sub-blocks x (m, B): qw·sqrt(2·Σx²/256 + x²), or x² without qw."""
    if qw is None:
        return x * x
    S = x.shape[1] * m // 256
    xt = x.T.reshape(S, 256).T
    sigma2 = div_by(seq_sum(xt * xt) * 2.0, 256.0).repeat_interleave(256 // m)
    return qw.reshape(-1, m).T * sqrt(sigma2 + x * x)


def _prefix(v: torch.Tensor) -> torch.Tensor:
    """Running float32 sums (m+1, B) of v (m, B) from 0, in order (C's s[j+1] = s[j] + v[j])."""
    out = [torch.zeros_like(v[0])]
    for j in range(v.shape[0]):
        out.append(out[-1] + v[j])
    return torch.stack(out)


def _pairs(m: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The split points (i1, i2), 0 <= i1 <= i2 <= m, in ggml's loop order."""
    i1, i2 = torch.triu_indices(m + 1, m + 1, device=device)
    return i1, i2


def _scan(sumqx: torch.Tensor, sumq2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's candidate scan over dim 0 of (C, B): best = -FLT_MAX; a candidate with sumq2 > 0 and
    sumqx² > best·sumq2 takes scale = sumqx/sumq2 and best = scale·sumqx. Returns (winner or -1, scale).

    Every candidate's scale, score and square are elementwise and computed at once (the same float32
    operations); only the comparison with the running best is sequential."""
    C, B = sumqx.shape
    ok = sumq2 > 0
    scale = sumqx / torch.where(ok, sumq2, 1.0)
    score = scale * sumqx
    sq = sumqx * sumqx
    best = torch.full((B,), -torch.finfo(F32).max, dtype=F32, device=sumqx.device)
    win = torch.full((B,), -1, dtype=torch.int64, device=sumqx.device)
    for c in range(C):
        better = ok[c] & (sq[c] > best * sumq2[c])
        best = torch.where(better, score[c], best)
        win = torch.where(better, c, win)
    found = win >= 0
    picked = scale.gather(0, win.clamp_min(0)[None])[0]
    return win, torch.where(found, picked, 0.0)


def _levels(x: torch.Tensor, order: torch.Tensor, i1: torch.Tensor, i2: torch.Tensor) -> torch.Tensor:
    """Levels (m, B): 0 for the weights sorted before i1, 1 before i2, 2 after."""
    rank = torch.empty_like(order)
    rank.scatter_(0, order, torch.arange(x.shape[0], device=x.device)[:, None].expand_as(order))
    return (rank >= i1).to(torch.int64) + (rank >= i2).to(torch.int64)


def _snap(L: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
          vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codebook entries (ng, B) of the level groups L (ng, 8, B); an off-codebook group takes its best neighbour
    for x, w (ng, 8, B), scale (B,) and level values vals (ng, 3, B). Returns (entries, off-codebook mask)."""
    cb = device_codebook("IQ1_S", str(x.device))
    codes = (L << cb.shifts.to(torch.int64)[:, None]).sum(1)
    gi = cb.kmap[codes]
    off = gi < 0
    k, b = torch.nonzero(off, as_tuple=True)
    if k.numel():
        rows = cb.nb_row[codes[k, b]]
        xv, wv, vv = x[k, :, b], w[k, :, b], vals[k, :, b]
        best = nearest_binned(cb, rows, xv, wv, scale[b], vv, widths=_WIDTHS, slots=SLOTS_PER_BATCH)
        gi = gi.clone()
        gi[k, b] = best
    return gi, off


def _refit(gi: torch.Tensor, x: torch.Tensor, w: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ w·q·x, Σ w·q²) over each sub-block in order, q the value of each weight's level in entries gi (ng, B)."""
    cb = device_codebook("IQ1_S", str(x.device))
    lev = cb.levels[gi].permute(0, 2, 1)                               # (ng, 8, B)
    q = torch.gather(vals, 1, lev.to(torch.int64))                     # (ng, 8, B)
    ng, g, B = q.shape
    wq = w * q
    return seq_sum((wq * x).reshape(ng * g, B)), seq_sum((wq * q).reshape(ng * g, B))


def _sorted_sums(x: torch.Tensor, w: torch.Tensor, half: torch.Tensor | None = None):
    """Stable ascending order of each sub-block (m, B) and the prefix sums of w·x and w in that order; with
    ``half`` (m,) the sums run per half (h, m+1, B), each over that half's weights only."""
    order = torch.sort(x, dim=0, stable=True).indices
    wx = torch.gather(w * x, 0, order)
    ws = torch.gather(w, 0, order)
    if half is None:
        return order, _prefix(wx), _prefix(ws)
    hs = half[order]                                                   # (m, B): the half of each sorted weight
    zero = torch.zeros((), dtype=F32, device=x.device)
    px = torch.stack([_prefix(torch.where(hs == h, wx, zero)) for h in (0, 1)])
    pw = torch.stack([_prefix(torch.where(hs == h, ws, zero)) for h in (0, 1)])
    return order, px, pw


def _vals(minus: torch.Tensor) -> torch.Tensor:
    """Level values (..., 3, B) of groups with a minus (True) or plus delta (..., B)."""
    p = torch.tensor(_PLUS, dtype=F32, device=minus.device)
    m = torch.tensor(_MINUS, dtype=F32, device=minus.device)
    return torch.where(minus[..., None, :], m[:, None], p[:, None])


def _le_bytes(v: torch.Tensor, nbytes: int) -> torch.Tensor:
    v = v.to(torch.int64)
    return torch.stack([(v >> (8 * i)) & 0xFF for i in range(nbytes)], dim=-1).reshape(*v.shape[:-1], -1).to(
        torch.uint8)


def _snap_and_refit(x: torch.Tensor, w: torch.Tensor, L: torch.Tensor, scale: torch.Tensor, vals: torch.Tensor,
                    live: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every group of 8 levels snapped onto the codebook (``_snap``), and the scale of a block whose groups moved
    refit to the snapped entries; blocks that are not ``live`` get entry 0 and scale 0. x, w (groups·8, B)."""
    B = x.shape[1]
    xg, wg = x.reshape(groups, 8, B), w.reshape(groups, 8, B)
    gi, off = _snap(L.reshape(groups, 8, B), xg, wg, scale, vals)
    sqx, sq2 = _refit(gi, xg, wg, vals)
    redo = off.any(0) & (sqx > 0) & (sq2 > 0)
    scale = torch.where(redo, sqx / torch.where(redo, sq2, 1.0), scale)
    return torch.where(live, gi, 0), torch.where(live, scale, 0.0)


def encode_iq1_s(xs: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """IQ1_S blocks (50 bytes) of super-blocks xs (S, 256); qw (S, 256) importance is required (as in ggml)."""
    if qw is None:
        raise InputError("IQ1_S needs an importance matrix (as in llama.cpp)")
    S, m = xs.shape[0], 32
    B = S * 8
    x = xs.reshape(B, m).T.contiguous()
    w = _weights(x, qw, m)
    zero = x.abs().amax(0) < GROUP_MAX_EPS_IQ1_S
    order, sx, sw = _sorted_sums(x, w)
    i1, i2 = _pairs(m, xs.device)
    a, b, c = sx[i1] - sx[0], sx[i2] - sx[i1], sx[m] - sx[i2]
    wa, wb, wc = sw[i1] - sw[0], sw[i2] - sw[i1], sw[m] - sw[i2]
    qx = torch.stack([a * v[0] + b * v[1] + c * v[2] for v in (_PLUS, _MINUS)], 1).reshape(-1, B)
    q2 = torch.stack([wa * v[0] * v[0] + wb * v[1] * v[1] + wc * v[2] * v[2] for v in (_PLUS, _MINUS)], 1)
    win, scale = _scan(qx, q2.reshape(-1, B))
    live = (win >= 0) & ~zero
    pick = win.clamp_min(0)
    minus = (pick % 2) == 1
    L = _levels(x, order, i1[pick // 2], i2[pick // 2])
    neg = scale < 0
    L = torch.where(neg, 2 - L, L)
    scale = torch.where(neg, -scale, scale)
    minus = minus ^ neg
    vals = _vals(minus)[None].expand(4, 3, B)
    gi, scale = _snap_and_refit(x, w, L, scale, vals, live, 4)
    minus = minus & live

    sc = scale.reshape(S, 8)
    max_scale = sc.amax(1)
    dead = max_scale == 0
    d = div_by(torch.where(dead, 1.0, max_scale), 15.0)
    h, _ = fp16_bits(d * D_FACTOR_IQ1_S)
    h = torch.where(dead, 0, h)
    ls = torch.clamp(nearest_int((rdiv(1.0, d)[:, None] * sc - 1.0) * 0.5), 0, 7).to(torch.int64)
    ls = ls | (minus.reshape(S, 8).to(torch.int64) << 3)
    ls = torch.where(dead[:, None], 0, ls)
    g = gi.reshape(4, S, 8).permute(1, 2, 0)                           # (S, sub-block, group)
    qh = ((g >> 8) << (3 * torch.arange(4, device=xs.device))).sum(2) | (ls << 12)
    out = torch.cat([half_bytes(h), (g & 255).reshape(S, 32).to(torch.uint8), _le_bytes(qh, 2)], dim=1)
    return out


def encode_iq1_m(xs: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """IQ1_M blocks (56 bytes) of super-blocks xs (S, 256); qw (S, 256) optional importance."""
    S, m = xs.shape[0], 16
    B = S * 16
    x = xs.reshape(B, m).T.contiguous()
    w = _weights(x, qw, m)
    zero = x.abs().amax(0) < GROUP_MAX_EPS_IQ1_M
    half = (torch.arange(m, device=xs.device) >= m // 2).to(torch.int64)
    order, px, pw = _sorted_sums(x, w, half)
    i1, i2 = _pairs(m, xs.device)
    p2, m2 = _PLUS[2], _MINUS[2]
    cp1, cp2 = f32(_PLUS[0] * _PLUS[0] - _PLUS[1] * _PLUS[1]), f32(_PLUS[1] * _PLUS[1] - _PLUS[2] * _PLUS[2])
    cm1, cm2 = f32(_MINUS[0] * _MINUS[0] - _MINUS[1] * _MINUS[1]), f32(_MINUS[1] * _MINUS[1] - _MINUS[2] * _MINUS[2])
    qx_p, qx_m, q2_p, q2_m = [], [], [], []
    for h in (0, 1):
        tx, tw = px[h, m], pw[h, m]
        sx = px[h, i1] + px[h, i2]
        qx_p.append(tx * p2 - sx)
        qx_m.append(tx * m2 - sx)
        q2_p.append(tw * p2 * p2 + pw[h, i1] * cp1 + pw[h, i2] * cp2)
        q2_m.append(tw * m2 * m2 + pw[h, i1] * cm1 + pw[h, i2] * cm2)
    # shift k: (first half, second half) deltas 0 (+,+), 1 (+,-), 2 (-,+), 3 (-,-)
    qx = torch.stack([qx_p[0] + qx_p[1], qx_p[0] + qx_m[1], qx_m[0] + qx_p[1], qx_m[0] + qx_m[1]], 1)
    q2 = torch.stack([q2_p[0] + q2_p[1], q2_p[0] + q2_m[1], q2_m[0] + q2_p[1], q2_m[0] + q2_m[1]], 1)
    win, scale = _scan(qx.reshape(-1, B), q2.reshape(-1, B))
    live = (win >= 0) & ~zero
    pick = win.clamp_min(0)
    shift = pick % 4
    L = _levels(x, order, i1[pick // 4], i2[pick // 4])
    neg = scale < 0
    L = torch.where(neg, 2 - L, L)
    scale = torch.where(neg, -scale, scale)
    shift = torch.where(neg, 3 - shift, shift)
    minus = torch.stack([shift >= 2, (shift % 2) == 1])                # (2, B): the delta sign of each group
    vals = _vals(minus)
    gi, scale = _snap_and_refit(x, w, L, scale, vals, live, 2)
    shift = torch.where(live, shift, 0)

    sc = scale.reshape(S, 16)
    max_scale = sc.amax(1)
    dead = max_scale == 0
    d = div_by(torch.where(dead, 1.0, max_scale), 15.0)
    ls = torch.clamp(nearest_int((rdiv(1.0, d)[:, None] * sc - 1.0) * 0.5), 0, 7).to(torch.int64)   # (S, 16)
    # the super-block scale is refit over all 256 weights with the stored levels, sub-block scales and deltas
    vals = _vals(torch.stack([shift >= 2, (shift % 2) == 1]))          # (2, 3, B)
    cb = device_codebook("IQ1_S", str(xs.device))
    lev = cb.levels[gi].permute(0, 2, 1).to(torch.int64)               # (2, 8, B)
    q = torch.gather(vals, 1, lev) * (2 * ls.reshape(B) + 1).to(F32)   # (2, 8, B)
    q = q.permute(2, 0, 1).reshape(S, 256).T
    w256 = w.T.reshape(S, 256).T
    x256 = xs.T
    wq = w256 * q
    sqx, sq2 = seq_sum(wq * x256), seq_sum(wq * q)
    d = torch.where(sq2 > 0, sqx / torch.where(sq2 > 0, sq2, 1.0), d)
    hb, _ = fp16_bits(d * D_FACTOR_IQ1_M)
    hb = hb.to(torch.int64) & 0xFFFF
    masks = torch.tensor([0x00, 0x80, 0x08, 0x88], dtype=torch.int64, device=xs.device)
    g = gi.reshape(2, S, 16).permute(1, 2, 0)                          # (S, sub-block, group)
    qh = (g[..., 0] >> 8) | ((g[..., 1] >> 8) << 4) | torch.where(dead[:, None], 0, masks[shift.reshape(S, 16)])
    scl = (ls.reshape(S, 4, 4) << (3 * torch.arange(4, device=xs.device))).sum(2)   # (S, 4) uint16 words
    scl = scl | (((hb[:, None] >> (4 * torch.arange(4, device=xs.device))) & 0xF) << 12)
    scl = torch.where(dead[:, None], 0, scl)
    out = torch.cat([(g & 255).reshape(S, 32).to(torch.uint8), qh.to(torch.uint8), _le_bytes(scl, 2)], dim=1)
    return out
