"""Scale searches of ggml's K-quant encoders, vectorised over blocks in float32 numpy.

Every array here has the element index on axis 0 and any number of batch axes after it
(blocks, sub-blocks, super-blocks). Bit-exactness with ggml needs its float32 evaluation order:
products are evaluated left to right, sums are accumulated sequentially in element order
(``np.add.reduce`` over axis 0 of such an array does exactly that, not a pairwise sum), and
rounding uses ggml's "add 1.5*2^23" trick, reproduced bit for bit by :func:`nearest_int`.
Loops run over the few candidate scales (and coordinate-descent positions), never over blocks.
"""
from __future__ import annotations

import numpy as np

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)
_MAGIC = F32(12582912.0)  # 1.5 * 2**23


def f32(v: float | int) -> np.float32:
    """A float32 constant (keeps every operation in float32, as C does with float literals)."""
    return F32(v)


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even via the float32 magic-number trick (int32 result).

    Reproduced through the bit pattern rather than np.rint so that out-of-range inputs (which
    ggml never asserts in release builds) give ggml's value too.
    """
    t = np.asarray(v, dtype=F32) + _MAGIC
    return (t.view(np.int32) & 0x007FFFFF) - 0x00400000


def fp16_round(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round float32 to IEEE half (round to nearest even); return (half array, its float32 value).

    Every NaN becomes the half of x86's default NaN (0xFE00), which is what ggml stores for the NaNs
    it computes (weights whose squares overflow float32): the sign of a NaN depends on the operations
    that made it, and differs between numpy's and torch's paths for the same (meaningless) value.
    """
    v = np.asarray(v, dtype=F32)
    h = v.astype(np.float16)
    nan = np.isnan(v)
    if nan.any():
        h = np.where(nan, np.array(0xFE00, np.uint16).view(np.float16), h)
    return h, h.astype(F32)


def seq_sum(a: np.ndarray) -> np.ndarray:
    """Sequential float32 sum over axis 0 (the element index), as a C loop ``s = 0; s += a[i]`` does.

    ``np.add.reduce`` over axis 0 of a C-contiguous array with two or more blocks adds whole slices
    in order (the blocks form the inner loop); with a single block the reduced axis becomes the
    inner loop and numpy sums pairwise, which rounds differently, so that case loops explicitly.
    The recorded-digest tests pin this behaviour.
    """
    if a.ndim > 1 and a[0].size > 1:
        return np.add.reduce(np.ascontiguousarray(a), axis=0)
    s = np.zeros(a.shape[1:], dtype=F32)
    for i in range(a.shape[0]):
        s += a[i]
    return s


def seq_sum_from_first(a: np.ndarray) -> np.ndarray:
    """Sequential sum seeded with a[0] (C: ``s = a[0]; for i >= 1: s += a[i]``).

    Differs from :func:`seq_sum` (seeded with +0) only when every term is -0.0.
    """
    s = seq_sum(a)
    all_neg_zero = np.all((a == 0) & np.signbit(a), axis=0)
    return np.where(all_neg_zero, f32(-0.0), s)


def first_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(amax, signed value) of the first element with the largest |x| along axis 0."""
    ax = np.abs(x)
    # ggml's strict '>' scan from 0 skips NaN (which overflowing inputs can produce)
    amax = np.fmax(np.fmax.reduce(ax, axis=0), f32(0))
    val = np.zeros_like(amax)
    for i in range(x.shape[0] - 1, -1, -1):  # backwards, so the first match is written last
        np.copyto(val, x[i], where=(ax[i] == amax) & (amax > 0))
    return amax, val


def first_min(x: np.ndarray) -> np.ndarray:
    """Minimum along axis 0 as a strict '<' scan from x[0] finds it (the sign of a zero minimum is
    that of its first occurrence, which np.min does not promise)."""
    mn = np.min(x, axis=0)
    z = mn == 0
    if z.any():
        xz = x[:, z]
        mn[z] = xz[np.argmax(xz == 0, axis=0), np.arange(xz.shape[1])]
    return mn


def make_qx_quants(x: np.ndarray, nmax: int, qw: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric signed search (ggml make_qx_quants with rmse_type=1): returns (scale, L in [0, 2*nmax)).

    Weights are ``qw`` if given, else x*x. Scale is signed (the largest-|x| element maps to -nmax).
    """
    amax, mx = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, f32(1), mx)  # |iscale * x| <= nmax + 1 then holds for every block
    w = x * x if qw is None else qw
    wx = w * x
    v, lf, tmp = (np.empty_like(x) for _ in range(3))

    def sums(iscale, out):
        np.multiply(x, iscale, out=v)
        _levels(v, -nmax, nmax - 1, out, False)
        np.multiply(wx, out, out=tmp)
        sumlx = seq_sum(tmp)
        np.multiply(w, out, out=tmp)
        np.multiply(tmp, out, out=tmp)
        return sumlx, seq_sum(tmp)

    L = np.empty_like(x)
    sumlx, suml2 = sums(f32(-nmax) / mx, L)
    scale = np.where(suml2 != 0, sumlx / suml2, f32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        sumlx, suml2 = sums(-(f32(nmax) + f32(0.1) * f32(step)) / mx, lf)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        if better.any():
            np.copyto(L, lf, where=better[None])
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    Li = L.astype(np.int32) + nmax
    Li[:, zero] = 0
    scale = np.where(zero, f32(0), scale)
    return scale.astype(F32), Li


def _descent(x: np.ndarray, w: np.ndarray, L: np.ndarray, sumlx: np.ndarray, suml2: np.ndarray,
             lo: int | None, hi: int, qp: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's coordinate descent of make_q3_quants (qp=False) / make_qp_quants (qp=True).

    Up to 5 sweeps over the elements; each tries the level that is optimal for the other levels'
    current sums and keeps it if the weighted fit improves. A block that changes nothing in a
    sweep is done (ggml stops it there), so later sweeps run on the still-changing blocks only.
    make_qp stores levels as uint8, hence the wrap.
    """
    shape = x.shape
    n = shape[0]
    x = x.reshape(n, -1)
    w = w.reshape(n, -1)
    L = np.ascontiguousarray(L, dtype=np.int32).reshape(n, -1)
    sumlx = np.array(sumlx, dtype=F32).reshape(-1)
    suml2 = np.array(suml2, dtype=F32).reshape(-1)
    wx = w * x
    idx = None
    for _ in range(5):
        if idx is None:
            xa, wa, wxa, La, sa, s2a = x, w, wx, L, sumlx, suml2
        else:
            xa, wa, wxa, La, sa, s2a = x[:, idx], w[:, idx], wx[:, idx], L[:, idx], sumlx[idx], suml2[idx]
        changed = np.zeros(sa.shape, dtype=bool)
        for i in range(n):
            li = La[i].astype(F32)
            slx = sa - wxa[i] * li
            sl2 = s2a - wa[i] * li * li
            new = np.minimum(nearest_int(xa[i] * sl2 / slx), hi)
            if lo is not None:
                new = np.maximum(new, lo)
            newf = new.astype(F32)
            slx2 = slx + wxa[i] * newf
            sl22 = sl2 + wa[i] * newf * newf
            gate = (slx > 0) & (sl2 > 0) if qp else (slx > 0) & (sl22 > 0)
            ok = gate & (new != La[i]) & (slx2 * slx2 * s2a > sa * sa * sl22)
            La[i] = np.where(ok, new & 0xFF if qp else new, La[i])
            sa = np.where(ok, slx2, sa)
            s2a = np.where(ok, sl22, s2a)
            changed |= ok
        if idx is None:
            sumlx, suml2 = sa, s2a
            idx = np.nonzero(changed)[0]
        else:
            L[:, idx], sumlx[idx], suml2[idx] = La, sa, s2a
            idx = idx[changed]
        if idx.size == 0:
            break
    return L.reshape(shape), sumlx.reshape(shape[1:]), suml2.reshape(shape[1:])


def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml make_q3_quants with do_rmse: rounding at -nmax/max, then 5 coordinate-descent sweeps.

    Returns (scale, L in [0, 2*nmax)); all-zero blocks give (0, L=0).
    """
    amax, mx = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, f32(1), mx)
    lo, hi = -nmax, nmax - 1
    iscale = f32(-nmax) / mx
    L = np.clip(nearest_int(iscale * x), lo, hi)
    w = x * x
    wx = w * x
    Lf = L.astype(F32)
    sumlx = seq_sum(wx * Lf)
    suml2 = seq_sum(w * Lf * Lf)
    L, sumlx, suml2 = _descent(x, w, L, sumlx, suml2, lo, hi, qp=False)
    scale = np.where(suml2 > 0, sumlx / suml2, f32(0))
    L = np.where(zero, 0, L + nmax)
    scale = np.where(zero, f32(0), scale)
    return scale.astype(F32), L.astype(np.int32)


def _levels(v: np.ndarray, lo: float, hi: float, out: np.ndarray, exact: bool) -> np.ndarray:
    """clip(nearest_int(v), lo, hi) as float32, written into ``out``.

    For |v| < 2^22, (v + 1.5*2^23) - 1.5*2^23 is exactly nearest_int(v) in float, which saves the
    int round trip; ``exact`` takes ggml's bit trick instead (callers set it when some |v| may be
    out of that range, where ggml's result is not a rounding).
    """
    if exact:
        np.copyto(out, np.clip(nearest_int(v), lo, hi), casting="unsafe")
        return out
    np.add(v, _MAGIC, out=out)
    np.subtract(out, _MAGIC, out=out)
    np.minimum(out, f32(hi), out=out)
    np.maximum(out, f32(lo), out=out)
    return out


_SAFE_RANGE = F32(4.0e6)


def make_qkx_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
                    use_mad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric weighted search (ggml make_qkx2_quants / make_qkx3_quants with weights given).

    Returns (scale, the_min >= 0, L in [0, nmax]); the block decodes as scale*L - the_min.
    """
    mn = first_min(x)
    mx = np.max(x, axis=0)  # the sign of a zero max never matters below
    sum_w = seq_sum_from_first(w)
    sum_x = seq_sum_from_first(w * x)
    mn = np.where(mn > 0, f32(0), mn)
    degenerate = ~(mx > mn)  # qkx2 tests max == min, qkx3 max <= min: equal once min <= max holds
    one = f32(1)
    v, lf, wl, tmp = (np.empty_like(x) for _ in range(4))

    def err_sum(scale, mn_, l):
        np.multiply(l, scale, out=tmp)
        np.add(tmp, mn_, out=tmp)
        np.subtract(tmp, x, out=tmp)
        if use_mad:
            np.abs(tmp, out=tmp)
        else:
            np.multiply(tmp, tmp, out=tmp)
        np.multiply(tmp, w, out=tmp)
        return seq_sum(tmp)

    def levels_at(iscale, cur_min, out):
        # |iscale * (x - min)| stays near nmax unless a block is (nearly) degenerate
        spread = np.maximum(mx - cur_min, cur_min - mn)
        exact = not bool(np.all(np.abs(iscale * spread) < _SAFE_RANGE))
        np.subtract(x, cur_min, out=v)
        np.multiply(v, iscale, out=v)
        return _levels(v, 0, nmax, out, exact)

    iscale = f32(nmax) / np.where(degenerate, one, mx - mn)
    scale = one / iscale
    L = levels_at(iscale, mn, np.empty_like(x))
    best = err_sum(scale, mn, L)
    cur_min = mn
    for step in range(nstep + 1):
        # ggml updates its running min when a candidate wins, and later candidates are
        # placed relative to that updated min
        den = np.where(degenerate, one, mx - cur_min)
        iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / den
        levels_at(iscale, cur_min, lf)
        np.multiply(w, lf, out=wl)
        sum_l = seq_sum(wl)
        np.multiply(wl, lf, out=tmp)
        sum_l2 = seq_sum(tmp)
        np.multiply(wl, x, out=tmp)
        sum_xl = seq_sum(tmp)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        this_min = np.where(pos, f32(0), this_min)
        this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
        cur = err_sum(this_scale, this_min, lf)
        better = (D > 0) & (cur < best) & ~degenerate
        if better.any():
            np.copyto(L, lf, where=better[None])
            best = np.where(better, cur, best)
            scale = np.where(better, this_scale, scale)
            cur_min = np.where(better, this_min, cur_min)
    scale = np.where(degenerate, f32(0), scale)
    the_min = -np.where(degenerate, mn, cur_min)
    Li = L.astype(np.int32)
    Li[:, degenerate] = 0
    return scale.astype(F32), the_min.astype(F32), Li


def make_qp_quants(x: np.ndarray, nmax: int, qw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml make_qp_quants: quantise non-negative values (sub-block scales) to [0, nmax] with weights.

    Returns (scale, L as uint8).
    """
    mx = np.maximum(np.max(x, axis=0), f32(0))
    zero = mx < GROUP_MAX_EPS
    mx = np.where(zero, f32(1), mx)
    wx = qw * x

    def mse(scale, l):
        diff = x - scale * l.astype(F32)
        return seq_sum(qw * diff * diff)

    iscale = f32(nmax) / mx
    best = mse(f32(1) / iscale, nearest_int(iscale * x) & 0xFF)  # stored as uint8 in ggml
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (f32(0.1) * f32(step) + f32(nmax)) / mx
        l = np.minimum(nmax, nearest_int(iscale_is * x))
        cur = mse(f32(1) / iscale_is, l)
        better = cur < best
        best = np.where(better, cur, best)
        iscale = np.where(better, iscale_is, iscale)
    l = np.minimum(nmax, nearest_int(iscale * x))
    lf = l.astype(F32)
    sumlx = seq_sum(wx * lf)
    suml2 = seq_sum(qw * lf * lf)
    L, sumlx, suml2 = _descent(x, qw, l & 0xFF, sumlx, suml2, None, nmax, qp=True)
    scale = np.where(suml2 > 0, sumlx / suml2, f32(0))
    scale = np.where(zero, f32(0), scale)
    L = np.where(zero, 0, L)
    return scale.astype(F32), L.astype(np.uint8)
