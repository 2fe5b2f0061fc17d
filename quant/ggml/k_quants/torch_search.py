"""Scale searches of ggml's K-quant encoders in torch, bit-exact with ggml on CPU and on CUDA.

Every tensor here has the element index on dim 0 and the blocks (sub-blocks, super-blocks) on the
dims after it, so that ``a[i]`` is one contiguous slice and a sum over the elements is a loop of
slice additions in ggml's order. The rules that keep the bytes equal to ggml's float32 C code on
every device:

- one IEEE float32 operation per torch op: no fused ops (``addcmul``, ``addmm``, ``lerp``), no
  reductions for sums (``sum``/``cumsum``/``matmul`` reorder or widen the additions);
- never divide by a Python number or by ``c / tensor`` with c != 1: torch turns those into a
  multiplication by a reciprocal on CUDA (two roundings); :func:`rdiv` divides by a tensor;
- square roots through float64 (:func:`sqrt`): torch's float32 CPU root is not always correctly rounded;
- device-independent results where ggml's x86 build meets NaN: :func:`nearest_int` and
  :func:`to_int32` give what x86 gives for NaN and out-of-range values (CUDA's conversions saturate),
  :func:`fp16_bits` writes x86's default NaN as a half. (NaN only arises where squares of the weights
  overflow float32, |x| > 1.8e19, where ggml's own output is meaningless or it aborts.)
Loops run over the few candidate scales and the 16 or 32 elements of a block, never over blocks.
"""
from __future__ import annotations

import numpy as np
import torch

from mixq.quant.ggml.triton_kernels import search as triton_search

from mixq.quant.ggml.triton_kernels import descent as triton_descent

F32 = torch.float32
_MAGIC = 12582912.0  # 1.5 * 2**23: adding it rounds to an integer in the low mantissa bits
_INT_MIN = -2147483648.0


def f32(v: float) -> float:
    """The float32 value of v, as a Python float (C's float literals, evaluated in float)."""
    return float(np.float32(v))


GROUP_MAX_EPS = f32(1e-15)


def rdiv(c: float, t: torch.Tensor) -> torch.Tensor:
    """c / t in float32 with one rounding (torch's ``c / t`` is ``c * (1 / t)``)."""
    return torch.div(t.new_full((), c), t)


def div_by(t: torch.Tensor, c: float) -> torch.Tensor:
    """t / c in float32 with one rounding (on CUDA, ``t / c`` multiplies by a rounded 1/c)."""
    return torch.div(t, t.new_full((), c))


def nearest_int(v: torch.Tensor) -> torch.Tensor:
    """ggml's nearest_int (round half to even via the magic-number add), int32, bit for bit.

    Out-of-range inputs give ggml's value too (the low mantissa bits); NaN gives 0, as the x86 default
    NaN (0xFFC00000) does there, whatever NaN the device produced.
    """
    t = (v + _MAGIC).view(torch.int32)
    r = (t & 0x007FFFFF) - 0x00400000
    return torch.where(torch.isnan(v), 0, r)


def round_levels(v: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """clamp(nearest_int(v), lo, hi) as float32, for |v| < 2^22 (then the float round trip is exact)."""
    return torch.clamp(torch.round(v), lo, hi)


def sqrt(v: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root on every device.

    torch's float32 CPU sqrt may go through a vector math library that is off by an ulp; the float64
    root rounded to float32 is the correctly rounded float32 root (53 >= 2*24 + 2 bits).
    """
    return torch.sqrt(v.to(torch.float64)).to(F32)


def to_int32(v: torch.Tensor) -> torch.Tensor:
    """float -> int32 truncation with x86's answer for NaN and out-of-range values (INT_MIN)."""
    ok = torch.abs(v) < 2147483648.0
    return torch.where(ok, v, _INT_MIN).to(torch.int32)


def fp16_bits(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round float32 to IEEE half (nearest even): (int16 bit patterns, their float32 values).

    NaN becomes 0xFE00, the half of x86's default NaN (0xFFC00000), which is what ggml's x86 build
    stores for a NaN it computed; devices differ in the NaN they generate (CUDA's is positive).
    """
    h = v.to(torch.float16)
    bits = torch.where(torch.isnan(v), -512, h.view(torch.int16)).to(torch.int16)
    return bits, h.to(F32)


def half_bytes(bits: torch.Tensor) -> torch.Tensor:
    """int16 bit patterns (S,) -> uint8 (S, 2) little-endian."""
    b = bits.to(torch.int32)
    return torch.stack([b & 0xFF, (b >> 8) & 0xFF], dim=-1).to(torch.uint8)


def _fused_sum(a: torch.Tensor, from_first: bool) -> torch.Tensor | None:
    """The fused sequential sum for long sums on accelerators (one kernel instead of one per element)."""
    if a.shape[0] < 8 or a.dim() < 2 or not triton_search.use_fused(a):
        return None
    def check() -> bool:
        c = torch.cat([triton_search.edge_blocks(a.shape[0], a.device)[0],
                       triton_search.check_columns(a.reshape(a.shape[0], -1))], dim=1)
        return triton_search.same(triton_descent.seq_sum(c, from_first), _seq_sum_eager(c, from_first))
    if triton_search.variant_ok(("seqsum", a.shape[0], from_first, str(a.device)), check):
        return triton_descent.seq_sum(a, from_first)
    return None


def _seq_sum_eager(a: torch.Tensor, from_first: bool) -> torch.Tensor:
    s = a[0].clone() if from_first else a[0] + 0.0
    for i in range(1, a.shape[0]):
        s.add_(a[i])
    return s


def seq_sum(a: torch.Tensor) -> torch.Tensor:
    """Sequential float32 sum over dim 0 as C's ``s = 0; for i: s += a[i]`` (so -0.0 sums to +0.0)."""
    fused = _fused_sum(a, False)
    if fused is not None:
        return fused
    s = a[0] + 0.0
    for i in range(1, a.shape[0]):
        s.add_(a[i])
    return s


def seq_sum_from_first(a: torch.Tensor) -> torch.Tensor:
    """Sequential sum seeded with a[0] (C: ``s = a[0]; for i >= 1: s += a[i]``)."""
    fused = _fused_sum(a, True)
    if fused is not None:
        return fused
    s = a[0].clone()
    for i in range(1, a.shape[0]):
        s.add_(a[i])
    return s


def nanskip_max(v: torch.Tensor) -> torch.Tensor:
    """Max over dim 0 ignoring NaN (-inf when all are NaN), as ggml's strict '>' scans see it."""
    return torch.where(torch.isnan(v), -float("inf"), v).amax(0)


def pos_max(v: torch.Tensor) -> torch.Tensor:
    """max(0, max over dim 0) as ggml's '>' scan from +0 gives it (NaN skipped, never -0.0)."""
    m = nanskip_max(v)
    return torch.where(m > 0, m, 0.0)


def first_absmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax, signed value) of the first element with the largest |x| along dim 0 (0, 0 if none > 0)."""
    ax = torch.abs(x)
    amax = torch.clamp_min(nanskip_max(ax), 0.0)
    hit = ((ax == amax) & (amax > 0)).to(torch.uint8)
    idx = torch.argmax(hit, dim=0, keepdim=True)  # the first maximum
    val = torch.gather(x, 0, idx)[0]
    return amax, torch.where(amax > 0, val, 0.0)


def first_min(x: torch.Tensor) -> torch.Tensor:
    """Minimum along dim 0 as a strict '<' scan from x[0] finds it (a zero keeps its first sign)."""
    mn = x.amin(0)
    idx = torch.argmax((x == 0).to(torch.uint8), dim=0, keepdim=True)
    return torch.where(mn == 0, torch.gather(x, 0, idx)[0], mn)


def make_qx_quants(x: torch.Tensor, nmax: int, qw: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric signed search (ggml make_qx_quants, rmse_type 1): (scale, L int32 in [0, 2*nmax)).

    Weights are ``qw`` if given, else x*x; 19 candidate scales around -nmax/max. Runs the fused kernel
    of :mod:`triton_kernels.search` where it is in use for x's device.
    """
    if triton_search.use_fused(x):
        def check() -> bool:
            ex, ew = triton_search.edge_blocks(x.shape[0], x.device)
            cx = torch.cat([ex, triton_search.check_columns(x.reshape(x.shape[0], -1))], dim=1)
            cw = None if qw is None else torch.cat([ew, triton_search.check_columns(qw.reshape(x.shape[0], -1))], 1)
            return triton_search.same(triton_search.qx_search(cx, nmax, cw, GROUP_MAX_EPS),
                                      make_qx_quants_eager(cx, nmax, cw))
        key = ("qx", x.shape[0], nmax, qw is None, str(x.device))
        if triton_search.variant_ok(key, check):
            return triton_search.qx_search(x, nmax, qw, GROUP_MAX_EPS)
    return make_qx_quants_eager(x, nmax, qw)


def make_qx_quants_eager(x: torch.Tensor, nmax: int, qw: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`make_qx_quants` in elementwise torch ops."""
    amax, mx = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = torch.where(zero, 1.0, mx)  # |iscale * x| <= nmax + 1 then holds for every block
    w = x * x if qw is None else qw
    wx = w * x

    def sums(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lev = round_levels(x * iscale, -nmax, nmax - 1)
        wl = w * lev
        return lev, seq_sum(wx * lev), seq_sum(wl * lev)

    L, sumlx, suml2 = sums(rdiv(-nmax, mx))
    scale = torch.where(suml2 != 0, sumlx / suml2, 0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        lev, sumlx, suml2 = sums(rdiv(-(f32(nmax) + f32(f32(0.1) * f32(step))), mx))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = torch.where(better, lev, L)
        scale = torch.where(better, sumlx / suml2, scale)
        best = torch.where(better, scale * sumlx, best)
    Li = torch.where(zero, 0, to_int32(L) + nmax)
    return torch.where(zero, 0.0, scale), Li


def descent(x: torch.Tensor, w: torch.Tensor, L: torch.Tensor, sumlx: torch.Tensor, suml2: torch.Tensor,
            lo: int | None, hi: int, qp: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's coordinate descent of make_q3_quants (qp=False) / make_qp_quants (qp=True).

    Up to 5 sweeps over the elements; each tries the level that is optimal for the other levels' current
    sums and keeps it if the weighted fit improves. A sweep that changes nothing in a block changes
    nothing in later sweeps either, so every block runs until no block changes (ggml stops each block
    there). make_qp stores its levels as uint8, hence the wrap. L is int32 (n, ...), modified in place.
    """
    wx = w * x
    for _ in range(5):
        changed = torch.zeros_like(sumlx, dtype=torch.bool)
        for i in range(x.shape[0]):
            li = L[i].to(F32)
            slx = sumlx - wx[i] * li
            sl2 = suml2 - w[i] * li * li
            new = torch.clamp_max(nearest_int(x[i] * sl2 / slx), hi)
            if lo is not None:
                new = torch.clamp_min(new, lo)
            newf = new.to(F32)
            slx2 = slx + wx[i] * newf
            sl22 = sl2 + w[i] * newf * newf
            gate = (slx > 0) & ((sl2 > 0) if qp else (sl22 > 0))
            ok = gate & (new != L[i]) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[i] = torch.where(ok, new & 0xFF if qp else new, L[i])
            sumlx = torch.where(ok, slx2, sumlx)
            suml2 = torch.where(ok, sl22, suml2)
            changed |= ok
        if not bool(changed.any()):
            break
    return L, sumlx, suml2


def make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml make_q3_quants with do_rmse: rounding at -nmax/max, then coordinate descent.

    Returns (scale, L int32 in [0, 2*nmax)); all-zero blocks give (0, L=0).
    """
    if triton_search.use_fused(x):
        def check() -> bool:
            c = torch.cat([triton_search.edge_blocks(x.shape[0], x.device)[0],
                           triton_search.check_columns(x.reshape(x.shape[0], -1))], dim=1)
            return triton_search.same(triton_descent.q3_search(c, nmax, GROUP_MAX_EPS),
                                      make_q3_quants_eager(c, nmax))
        if triton_search.variant_ok(("q3", x.shape[0], nmax, str(x.device)), check):
            return triton_descent.q3_search(x, nmax, GROUP_MAX_EPS)
    return make_q3_quants_eager(x, nmax)


def make_q3_quants_eager(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`make_q3_quants` in elementwise torch ops."""
    amax, mx = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = torch.where(zero, 1.0, mx)
    L = torch.clamp(nearest_int(rdiv(-nmax, mx) * x), -nmax, nmax - 1)
    w = x * x
    Lf = L.to(F32)
    sumlx = seq_sum(w * x * Lf)
    suml2 = seq_sum(w * Lf * Lf)
    L, sumlx, suml2 = descent(x, w, L, sumlx, suml2, -nmax, nmax - 1, qp=False)
    scale = torch.where(suml2 > 0, sumlx / suml2, 0.0)
    return torch.where(zero, 0.0, scale), torch.where(zero, 0, L + nmax)


_SAFE_RANGE = 4.0e6  # |v| below 2^22 with margin: the float rounding equals ggml's bit trick


def make_qkx_quants(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                    use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric weighted search (ggml make_qkx2_quants / make_qkx3_quants with weights given).

    Returns (scale, the_min >= 0, L int32 in [0, nmax]); the block decodes as scale*L - the_min.
    Runs the fused kernel of :mod:`triton_kernels.search` where it is in use for x's device.
    """
    args = (nmax, rmin, rdelta, nstep, use_mad)
    if triton_search.use_fused(x):
        def check() -> bool:
            ex, ew = triton_search.edge_blocks(x.shape[0], x.device)
            cx = torch.cat([ex, triton_search.check_columns(x.reshape(x.shape[0], -1))], dim=1)
            cw = torch.cat([ew, triton_search.check_columns(w.reshape(x.shape[0], -1))], dim=1)
            return triton_search.same(triton_search.qkx_search(cx, cw, *args), make_qkx_quants_eager(cx, cw, *args))
        if triton_search.variant_ok(("qkx", x.shape[0], *args, str(x.device)), check):
            return triton_search.qkx_search(x, w, *args)
    return make_qkx_quants_eager(x, w, *args)


def make_qkx_quants_eager(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                          use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`make_qkx_quants` in elementwise torch ops."""
    mn = first_min(x)
    mx = x.amax(0)  # the sign of a zero max never matters below
    sum_w = seq_sum_from_first(w)
    sum_x = seq_sum_from_first(w * x)
    mn = torch.where(mn > 0, 0.0, mn)
    degenerate = ~(mx > mn)  # qkx2 tests max == min, qkx3 max <= min: equal once min <= max holds

    def err_sum(scale, mn_, lev):
        d = lev * scale + mn_ - x
        d = torch.abs(d) if use_mad else d * d
        return seq_sum(w * d)

    def levels_at(iscale, cur_min):
        v = (x - cur_min) * iscale
        # |iscale * (x - min)| stays near nmax unless a block is (nearly) degenerate
        spread = torch.maximum(mx - cur_min, cur_min - mn)
        if bool((torch.abs(iscale * spread) < _SAFE_RANGE).all()):
            return round_levels(v, 0, nmax)
        return torch.clamp(nearest_int(v), 0, nmax).to(F32)

    iscale = rdiv(nmax, torch.where(degenerate, 1.0, mx - mn))
    scale = rdiv(1.0, iscale)
    L = levels_at(iscale, mn)
    best = err_sum(scale, mn, L)
    cur_min = mn
    for step in range(nstep + 1):
        # ggml updates its running min when a candidate wins, and later candidates are placed
        # relative to that updated min
        den = torch.where(degenerate, 1.0, mx - cur_min)
        lf = levels_at(rdiv(f32(f32(f32(rmin) + f32(f32(rdelta) * f32(step))) + f32(nmax)), den), cur_min)
        wl = w * lf
        sum_l = seq_sum(wl)
        sum_l2 = seq_sum(wl * lf)
        sum_xl = seq_sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        this_min = torch.where(pos, 0.0, this_min)
        this_scale = torch.where(pos, sum_xl / sum_l2, this_scale)
        cur = err_sum(this_scale, this_min, lf)
        better = (D > 0) & (cur < best) & ~degenerate
        L = torch.where(better, lf, L)
        best = torch.where(better, cur, best)
        scale = torch.where(better, this_scale, scale)
        cur_min = torch.where(better, this_min, cur_min)
    scale = torch.where(degenerate, 0.0, scale)
    the_min = -torch.where(degenerate, mn, cur_min)
    return scale, the_min, torch.where(degenerate, 0, to_int32(L))


def make_qp_quants(x: torch.Tensor, nmax: int, qw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml make_qp_quants: quantise non-negative values (sub-block scales) to [0, nmax] with weights.

    Returns (scale, L int32 in [0, 255]: ggml keeps them as uint8).
    """
    if triton_search.use_fused(x):
        def check() -> bool:
            ex, ew = triton_search.edge_blocks(x.shape[0], x.device)
            cx = torch.cat([ex.abs(), triton_search.check_columns(x.reshape(x.shape[0], -1))], dim=1)
            cw = torch.cat([ew, triton_search.check_columns(qw.reshape(x.shape[0], -1))], dim=1)
            return triton_search.same(triton_descent.qp_search(cx, nmax, cw, GROUP_MAX_EPS),
                                      make_qp_quants_eager(cx, nmax, cw))
        if triton_search.variant_ok(("qp", x.shape[0], nmax, str(x.device)), check):
            return triton_descent.qp_search(x, nmax, qw, GROUP_MAX_EPS)
    return make_qp_quants_eager(x, nmax, qw)


def make_qp_quants_eager(x: torch.Tensor, nmax: int, qw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`make_qp_quants` in elementwise torch ops."""
    mx = torch.clamp_min(x.amax(0), 0.0)
    zero = mx < GROUP_MAX_EPS
    mx = torch.where(zero, 1.0, mx)
    wx = qw * x

    def mse(scale, lev):
        diff = x - scale * lev.to(F32)
        return seq_sum(qw * diff * diff)

    iscale = rdiv(nmax, mx)
    best = mse(rdiv(1.0, iscale), nearest_int(iscale * x) & 0xFF)  # uint8 in ggml
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = rdiv(f32(f32(f32(0.1) * f32(step)) + f32(nmax)), mx)
        cur = mse(rdiv(1.0, iscale_is), torch.clamp_max(nearest_int(iscale_is * x), nmax))
        better = cur < best
        best = torch.where(better, cur, best)
        iscale = torch.where(better, iscale_is, iscale)
    lev = torch.clamp_max(nearest_int(iscale * x), nmax)
    lf = lev.to(F32)
    sumlx = seq_sum(wx * lf)
    suml2 = seq_sum(qw * lf * lf)
    L, sumlx, suml2 = descent(x, qw, lev & 0xFF, sumlx, suml2, None, nmax, qp=True)
    scale = torch.where(suml2 > 0, sumlx / suml2, 0.0)
    return torch.where(zero, 0.0, scale), torch.where(zero, 0, L)
