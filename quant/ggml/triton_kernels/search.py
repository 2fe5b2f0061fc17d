"""Fused Triton kernels for the hot scale searches of the K-quant encoders, bit-exact with ggml on CUDA.

The eager torch searches (:mod:`torch_search`) make one pass over memory per float operation;
these kernels run ggml's per-block loops in registers instead, one block per lane: each lane walks
the 16 or 32 elements of its block in order (the sums stay sequential) for every candidate scale.
Exactness rules on top of the eager ones: kernels are compiled without fused multiply-add
(``enable_fp_fusion=False``), divisions are ``div_rn`` (Triton's ``/`` is approximate), rounding is
ggml's magic-number trick on the bit pattern, negation multiplies by -1 (Triton's ``-v`` is ``0 - v``,
which loses the sign of zero), and the winning candidate's levels are recomputed
from its scale rather than copied (the same float operations give the same levels).

``use_fused(x)`` says whether the kernels may run on x's device (CUDA, Triton importable); each kernel
variant is then trusted only after its first call's check against the eager search on edge-case
blocks and a slice of the real data (:func:`variant_ok`): a difference keeps the eager path, and the
bytes with it. Triton's CPU interpreter (``TRITON_INTERPRET=1`` before triton is imported) runs
the same kernels on CPU tensors, which is how the tests check them without a GPU.
"""
from __future__ import annotations

import os
import warnings
from functools import lru_cache
from typing import Callable

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None
    tl = None

F32 = torch.float32
LANES = 128          # blocks per program
# no fused multiply-add; no flush-to-zero of subnormals in libdevice's functions (div_rn)
_OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False, "num_warps": 4}
_ENV_OFF = "MIXQ_KQUANT_FUSED"  # "0" keeps the eager searches (benchmarks, debugging)


def _f32(v: float) -> float:
    return float(np.float32(v))


if triton is not None:
    @triton.jit
    def nearest_int_bits(v):
        """ggml nearest_int (bit trick), NaN -> 0 as on x86; int32."""
        t = (v + 12582912.0).to(tl.int32, bitcast=True)
        r = (t & 0x007FFFFF) - 0x00400000
        return tl.where(v != v, 0, r)

    @triton.jit
    def _level(x, mn, isc, NMAX: tl.constexpr):
        """clamp(nearest_int(isc * (x - mn)), 0, NMAX) as float."""
        lv = nearest_int_bits(isc * (x - mn))
        return tl.minimum(tl.maximum(lv, 0), NMAX).to(tl.float32)

    def _qkx_src(x_ptr, w_ptr, num_ptr, scale_ptr, min_ptr, L_ptr, B, NCAND: tl.constexpr,
                 NMAX: tl.constexpr, N: tl.constexpr, USE_MAD: tl.constexpr, LANES: tl.constexpr):
        """make_qkx2/3_quants per lane: x, w (N, B) element-major; num (NCAND,) iscale numerators."""
        lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
        m = lane < B
        x0 = tl.load(x_ptr + lane, mask=m, other=0.0)
        w0 = tl.load(w_ptr + lane, mask=m, other=0.0)
        mn = x0
        mx = x0
        sum_w = w0
        sum_x = w0 * x0
        for i in tl.static_range(1, N):
            xi = tl.load(x_ptr + i * B + lane, mask=m, other=0.0)
            wi = tl.load(w_ptr + i * B + lane, mask=m, other=0.0)
            mn = tl.where(xi < mn, xi, mn)
            mx = tl.where(xi > mx, xi, mx)
            sum_w = sum_w + wi
            sum_x = sum_x + wi * xi
        mn = tl.where(mn > 0, 0.0, mn)
        deg = ~(mx > mn)
        isc0 = tl.math.div_rn(tl.full([LANES], NMAX, tl.float32), tl.where(deg, 1.0, mx - mn))
        scale = tl.math.div_rn(tl.full([LANES], 1.0, tl.float32), isc0)
        best = tl.zeros([LANES], tl.float32)
        for i in tl.static_range(N):
            xi = tl.load(x_ptr + i * B + lane, mask=m, other=0.0)
            wi = tl.load(w_ptr + i * B + lane, mask=m, other=0.0)
            d = _level(xi, mn, isc0, NMAX) * scale + mn - xi
            if USE_MAD:
                d = tl.abs(d)
            else:
                d = d * d
            best = best + wi * d
        cur_min = mn
        win_isc = isc0
        win_min = mn
        for s in range(NCAND):
            num = tl.load(num_ptr + s)
            isc = tl.math.div_rn(tl.zeros([LANES], tl.float32) + num, tl.where(deg, 1.0, mx - cur_min))
            sum_l = tl.zeros([LANES], tl.float32)
            sum_l2 = tl.zeros([LANES], tl.float32)
            sum_xl = tl.zeros([LANES], tl.float32)
            for i in tl.static_range(N):
                xi = tl.load(x_ptr + i * B + lane, mask=m, other=0.0)
                wi = tl.load(w_ptr + i * B + lane, mask=m, other=0.0)
                lv = _level(xi, cur_min, isc, NMAX)
                wl = wi * lv
                sum_l = sum_l + wl
                sum_l2 = sum_l2 + wl * lv
                sum_xl = sum_xl + wl * xi
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = tl.math.div_rn(sum_w * sum_xl - sum_x * sum_l, D)
            this_min = tl.math.div_rn(sum_l2 * sum_x - sum_l * sum_xl, D)
            pos = this_min > 0
            this_min = tl.where(pos, 0.0, this_min)
            this_scale = tl.where(pos, tl.math.div_rn(sum_xl, sum_l2), this_scale)
            cur = tl.zeros([LANES], tl.float32)
            for i in tl.static_range(N):
                xi = tl.load(x_ptr + i * B + lane, mask=m, other=0.0)
                wi = tl.load(w_ptr + i * B + lane, mask=m, other=0.0)
                d = _level(xi, cur_min, isc, NMAX) * this_scale + this_min - xi
                if USE_MAD:
                    d = tl.abs(d)
                else:
                    d = d * d
                cur = cur + wi * d
            better = (D > 0) & (cur < best) & ~deg
            win_isc = tl.where(better, isc, win_isc)
            win_min = tl.where(better, cur_min, win_min)
            best = tl.where(better, cur, best)
            scale = tl.where(better, this_scale, scale)
            cur_min = tl.where(better, this_min, cur_min)
        tl.store(scale_ptr + lane, tl.where(deg, 0.0, scale), mask=m)
        tl.store(min_ptr + lane, tl.where(deg, mn, cur_min) * -1.0, mask=m)  # C's -min (Triton's -v is 0 - v)
        for i in tl.static_range(N):
            xi = tl.load(x_ptr + i * B + lane, mask=m, other=0.0)
            lv = _level(xi, win_min, win_isc, NMAX).to(tl.int32)
            tl.store(L_ptr + i * B + lane, tl.where(deg, 0, lv), mask=m)

    @triton.jit
    def _qx_sums(x_ptr, w_ptr, lane, m, B, isc, NMAX: tl.constexpr, N: tl.constexpr, W_IS_X2: tl.constexpr):
        """(sum w*x*l, sum w*l*l) over the N elements in order, l = clamp(nearest_int(isc*x), -NMAX, NMAX-1)."""
        sumlx = tl.zeros(isc.shape, tl.float32)
        suml2 = tl.zeros(isc.shape, tl.float32)
        for i in tl.static_range(N):
            xi = tl.load(x_ptr + i * B + lane, mask=m, other=0.0)
            if W_IS_X2:
                wi = xi * xi
            else:
                wi = tl.load(w_ptr + i * B + lane, mask=m, other=0.0)
            lv = tl.minimum(tl.maximum(nearest_int_bits(isc * xi), -NMAX), NMAX - 1).to(tl.float32)
            sumlx = sumlx + wi * xi * lv
            suml2 = suml2 + wi * lv * lv
        return sumlx, suml2

    def _qx_src(x_ptr, w_ptr, num_ptr, scale_ptr, L_ptr, B, NCAND: tl.constexpr,
                NMAX: tl.constexpr, N: tl.constexpr, W_IS_X2: tl.constexpr, EPS: tl.constexpr,
                LANES: tl.constexpr):
        """make_qx_quants (rmse_type 1) per lane: x, w (N, B); num (NCAND,) iscale numerators, first = -nmax."""
        lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
        m = lane < B
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
        isc = tl.math.div_rn(tl.zeros([LANES], tl.float32) + tl.load(num_ptr), mx)
        sumlx, suml2 = _qx_sums(x_ptr, w_ptr, lane, m, B, isc, NMAX, N, W_IS_X2)
        scale = tl.where(suml2 != 0, tl.math.div_rn(sumlx, suml2), 0.0)
        best = scale * sumlx
        win = isc
        for s in range(1, NCAND):
            isc = tl.math.div_rn(tl.zeros([LANES], tl.float32) + tl.load(num_ptr + s), mx)
            sumlx, suml2 = _qx_sums(x_ptr, w_ptr, lane, m, B, isc, NMAX, N, W_IS_X2)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            scale = tl.where(better, tl.math.div_rn(sumlx, suml2), scale)
            best = tl.where(better, scale * sumlx, best)
            win = tl.where(better, isc, win)
        tl.store(scale_ptr + lane, tl.where(zero, 0.0, scale), mask=m)
        for i in tl.static_range(N):
            xi = tl.load(x_ptr + i * B + lane, mask=m, other=0.0)
            lv = tl.minimum(tl.maximum(nearest_int_bits(win * xi), -NMAX), NMAX - 1) + NMAX
            tl.store(L_ptr + i * B + lane, tl.where(zero, 0, lv), mask=m)


@lru_cache(maxsize=None)
def _kernels():
    """The jitted kernels (created on first use, so that TRITON_INTERPRET set by then is honoured)."""
    return triton.jit(_qkx_src), triton.jit(_qx_src)


def launch_opts(device: torch.device, num_warps: int = 4) -> dict:
    """Compile options on CUDA (none in the interpreter)."""
    return dict(_OPTIONS, num_warps=num_warps) if device.type == "cuda" else {}


def qkx_search(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
               use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused make_qkx_quants: x, w (n, ...) -> (scale, the_min, L int32), as k_quants.torch_search's."""
    n, batch = x.shape[0], x.shape[1:]
    xf = x.reshape(n, -1).contiguous()
    wf = w.reshape(n, -1).contiguous()
    B = xf.shape[1]
    num = torch.tensor([_f32(_f32(_f32(rmin) + _f32(_f32(rdelta) * _f32(s))) + _f32(nmax)) for s in range(nstep + 1)],
                       dtype=F32, device=x.device)
    scale = torch.empty(B, dtype=F32, device=x.device)
    the_min = torch.empty(B, dtype=F32, device=x.device)
    L = torch.empty((n, B), dtype=torch.int32, device=x.device)
    qkx, _ = _kernels()
    qkx[(triton.cdiv(B, LANES),)](xf, wf, num, scale, the_min, L, B, nstep + 1, NMAX=nmax, N=n, USE_MAD=use_mad,
                                   LANES=LANES, **launch_opts(x.device))
    return scale.reshape(batch), the_min.reshape(batch), L.reshape(x.shape)


def qx_search(x: torch.Tensor, nmax: int, qw: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused make_qx_quants: x (n, ...), weights qw or x*x -> (scale, L int32 in [0, 2*nmax))."""
    n, batch = x.shape[0], x.shape[1:]
    xf = x.reshape(n, -1).contiguous()
    wf = xf if qw is None else qw.reshape(n, -1).contiguous()
    B = xf.shape[1]
    nums = [-float(nmax)] + [-_f32(_f32(nmax) + _f32(_f32(0.1) * _f32(s))) for s in range(-9, 10) if s != 0]
    num = torch.tensor(nums, dtype=F32, device=x.device)
    scale = torch.empty(B, dtype=F32, device=x.device)
    L = torch.empty((n, B), dtype=torch.int32, device=x.device)
    _, qx = _kernels()
    qx[(triton.cdiv(B, LANES),)](xf, wf, num, scale, L, B, len(nums), NMAX=nmax, N=n, W_IS_X2=qw is None, EPS=eps,
                                 LANES=LANES, **launch_opts(x.device))
    return scale.reshape(batch), L.reshape(x.shape)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@lru_cache(maxsize=None)
def _device_ok(device_key: str) -> bool:
    device = torch.device(device_key)
    return device.type == "cuda" or (device.type == "cpu" and _interpreting())


def fused_ok(device_key: str) -> bool:
    """Whether the fused searches may run on this device: CUDA (or CPU under Triton's interpreter), Triton
    importable, and not switched off by MIXQ_KQUANT_FUSED=0 (read at every call)."""
    if triton is None or os.environ.get(_ENV_OFF) == "0":
        return False
    return _device_ok(device_key)


def use_fused(x: torch.Tensor) -> bool:
    """True when the fused searches may encode x (on its device)."""
    if x.device.type == "cpu" and not _interpreting():
        return False
    return fused_ok(str(x.device) if x.device.type != "cuda" else f"cuda:{x.device.index or 0}")


_VARIANTS: dict[tuple, bool] = {}


def same(a, b) -> bool:
    """Bitwise equality of (tuples of) tensors; NaNs compare equal whatever their payload."""
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same(p, q) for p, q in zip(a, b))
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == F32:
        both_nan = torch.isnan(a) & torch.isnan(b)
        return bool(((a.view(torch.int32) == b.view(torch.int32)) | both_nan).all())
    return bool(torch.equal(a, b))


def checked_variants() -> dict[tuple, bool]:
    """The kernel variants checked so far in this process, each with whether it is trusted (``variant_ok``)."""
    return dict(_VARIANTS)


def variant_ok(key: tuple, check: Callable[[], bool]) -> bool:
    """Whether a kernel variant (``key``: kernel, its compile-time parameters, device) is trusted: on its
    first use ``check`` runs it against the eager search on a slice of the data and edge cases; a
    difference (or a compile error) keeps the eager path for that variant, with a warning."""
    if key not in _VARIANTS:
        try:
            _VARIANTS[key] = bool(check())
            reason = "differs from the eager path"
        except Exception as exc:  # a compiler or driver problem
            _VARIANTS[key] = False
            reason = f"failed: {exc}"
        if not _VARIANTS[key]:
            warnings.warn(f"mixq: fused kernel {key} {reason}; encoding with the eager path")
    return _VARIANTS[key]


def edge_blocks(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, w) (n, 64) blocks of edge cases for the variant checks: grid ties, zeros, tiny, subnormal and
    huge values, outliers, bf16 values, one-signed blocks, zero weights, next to Gaussian ones."""
    g = torch.Generator().manual_seed(20261201 + n)
    x = torch.randn(n, 64, generator=g)
    x[:, 8:16] = torch.randint(-3, 4, (n, 8), generator=g).float()
    x[:, 16:20] = 0.0
    x[:, 20] = -0.0
    x[:, 21:24] *= 1e-30
    x[:, 60:64] *= 1e-40                                                    # subnormal
    x[::7, 24:32] = 1e4
    x[:, 32:48] = (x[:, 32:48] * 0.02).to(torch.bfloat16).float()
    x[:, 48:52] = x[:, 48:52].abs() + 0.1
    x[:, 52:56] = -x[:, 52:56].abs() - 0.1
    w = torch.rand(n, 64, generator=g) + 0.1
    w[:, 56:60] = 0.0
    return x.to(device), w.to(device)


def check_columns(x: torch.Tensor, cols: int = 256) -> torch.Tensor:
    """The first ``cols`` blocks of x (n, B): the real data part of a variant check."""
    return x[:, :cols]
