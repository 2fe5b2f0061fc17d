"""Q2_K … Q6_K super-block encoders (256 weights per block), bit-exact with ggml.

Each ``encode_qN_k(xs, qw)`` takes super-blocks ``xs`` float32 (S, 256) and optional per-element
importance ``qw`` (S, 256) and returns uint8 (S, block_bytes). ``qw is None`` follows ggml's
reference quantizer (``quantize_row_*_ref``), otherwise its importance-weighted path
(``quantize_row_*_impl``). Internally arrays are (element, sub-block, super-block) so that the
searches in :mod:`numpy_search` sum in ggml's order.
"""
from __future__ import annotations

import numpy as np

from mixq.quant.ggml.k_quants.numpy_search import (F32, GROUP_MAX_EPS, f32, first_absmax, fp16_round, make_q3_quants,
                                                   make_qkx_quants, make_qp_quants, make_qx_quants, nearest_int,
                                                   seq_sum)


def _subblocks(xs: np.ndarray, m: int) -> np.ndarray:
    """(S, 256) -> (m, 256/m, S): element inside the sub-block, sub-block, super-block."""
    S = xs.shape[0]
    return np.ascontiguousarray(xs.reshape(S, 256 // m, m).transpose(2, 1, 0))


def _flat(L: np.ndarray) -> np.ndarray:
    """(m, 256/m, S) levels -> (S, 256) uint8 in element order."""
    return np.ascontiguousarray(L.transpose(2, 1, 0)).reshape(L.shape[2], 256).astype(np.uint8)


def _sigma2(xs_sub: np.ndarray, factor: int) -> np.ndarray:
    """factor * sum(x^2) / 256 over each super-block, summed in element order."""
    m, nsub, S = xs_sub.shape
    x = xs_sub.transpose(1, 0, 2).reshape(256, S)  # element order within the super-block
    sumx2 = seq_sum(x * x)
    return (f32(factor) * sumx2) / f32(256) if factor != 1 else sumx2 / f32(256)


def _requant(x: np.ndarray, L: np.ndarray, dsub: np.ndarray, lo: int, hi: int,
             offset: np.ndarray | None = None) -> np.ndarray:
    """Final pass with the stored (fp16-rounded) scales; sub-blocks whose scale is 0 keep L."""
    num = x if offset is None else x + offset[None]
    with np.errstate(all="ignore"):
        l = np.clip(nearest_int(num / dsub[None]), lo, hi)
    return np.where((dsub != 0)[None], l - lo if lo < 0 else l, L)


def _pack_2bit(L: np.ndarray) -> np.ndarray:
    """(S, 256) 2-bit levels -> (S, 64): byte 32h+l holds L[128h+l+32k] at bits 2k."""
    q = L.reshape(-1, 2, 4, 32).astype(np.uint8)
    out = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return out.reshape(-1, 64)


def _pos_max(v: np.ndarray) -> np.ndarray:
    """max(0, max over sub-blocks) as ggml's strict '>' scan from +0 gives it (never -0.0)."""
    m = np.fmax.reduce(v, axis=0)  # NaN-skipping, like the scan
    return np.where(m > 0, m, f32(0))


def _f16_bytes(h: np.ndarray) -> np.ndarray:
    return h.astype("<f2").view(np.uint8).reshape(-1, 2)


# ----------------------------------------------------------------------------- Q2_K

def encode_q2_k(xs: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """Q2_K: 16 sub-blocks of 16, 2-bit levels, 4-bit scale and min per sub-block (84 bytes)."""
    x = _subblocks(xs, 16)
    if qw is None:
        w = np.abs(x)
        scales, mins, L = make_qkx_quants(x, w, 3, -0.5, 0.1, 15, True)
        max_scale = _pos_max(scales)
        max_min = _pos_max(mins)
        has_s, has_m = max_scale > 0, max_min > 0
        ls = nearest_int((f32(15) / np.where(has_s, max_scale, f32(1)))[None] * scales)
        lm = nearest_int((f32(15) / np.where(has_m, max_min, f32(1)))[None] * mins)
        byte = np.where(has_s[None], ls & 0xFF, 0) | np.where(has_m[None], (lm << 4) & 0xFF, 0)
        d_h, d = fp16_round(np.where(has_s, max_scale / f32(15), f32(0)))
        m_h, dm = fp16_round(np.where(has_m, max_min / f32(15), f32(0)))
    else:
        sigma2 = _sigma2(x, 1)
        q = _subblocks(qw, 16)
        w = q * np.sqrt(sigma2[None, None] + x * x)
        sw = seq_sum(w)
        scales, mins, L = make_qkx_quants(x, w, 3, -0.9, 0.05, 36, False)
        dmv, Ls = make_qp_quants(scales, 15, sw)
        mmv, Lm = make_qp_quants(mins, 15, sw)
        d_h, d = fp16_round(dmv)
        m_h, dm = fp16_round(mmv)
        byte = (Ls.astype(np.int32) | (Lm.astype(np.int32) << 4)) & 0xFF
    dsub = d[None] * (byte & 0xF).astype(F32)
    msub = dm[None] * (byte >> 4).astype(F32)
    L = _requant(x, L, dsub, 0, 3, msub)
    out = np.empty((xs.shape[0], 84), np.uint8)
    out[:, 0:16] = byte.T
    out[:, 16:80] = _pack_2bit(_flat(L))
    out[:, 80:82] = _f16_bytes(d_h)
    out[:, 82:84] = _f16_bytes(m_h)
    return out


# ----------------------------------------------------------------------------- Q3_K

def encode_q3_k(xs: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """Q3_K: 16 sub-blocks of 16, 3-bit levels (2 low bits + hmask), 6-bit signed scales (110 bytes)."""
    x = _subblocks(xs, 16)
    if qw is None:
        scales, L = make_q3_quants(x, 4)
        _, max_scale = first_absmax(scales)
        nz = max_scale != 0
        iscale = f32(-32) / np.where(nz, max_scale, f32(1))
        l6 = np.clip(nearest_int(iscale[None] * scales).astype(np.int8), -32, 31).astype(np.int32) + 32
        l6 = np.where(nz[None], l6, 0)
        d_h, d = fp16_round(np.where(nz, f32(1) / iscale, f32(0)))
    else:
        sigma2 = _sigma2(x, 2)
        w = _subblocks(qw, 16) * np.sqrt(sigma2[None, None] + x * x)
        sw = seq_sum(w)
        scales, L = make_qx_quants(x, 4, w)
        d_block, l6 = make_qx_quants(scales, 32, sw)
        d_h, d = fp16_round(d_block)
    dsub = d[None] * (l6 - 32).astype(F32)
    L = _flat(_requant(x, L, dsub, -4, 3))
    high = L > 3
    L = np.where(high, L - 4, L)
    S = xs.shape[0]
    # element j: bit j//32 of hmask[j%32]
    hm = (high.reshape(S, 8, 32).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None])
    out = np.empty((S, 110), np.uint8)
    out[:, 0:32] = np.bitwise_or.reduce(hm, axis=1)
    out[:, 32:96] = _pack_2bit(L)
    out[:, 96:108] = pack_scales_q3_k(l6.T)
    out[:, 108:110] = _f16_bytes(d_h)
    return out


def pack_scales_q3_k(l6: np.ndarray) -> np.ndarray:
    """16 six-bit scales per block, stored +32 ((S, 16), 0..63) -> (S, 12): low nibbles two per byte, then the
    high 2-bit pairs four per byte."""
    s = np.asarray(l6).astype(np.uint8)
    sc = np.zeros((s.shape[0], 12), np.uint8)
    sc[:, 0:8] = (s[:, 0:8] & 0xF) | ((s[:, 8:16] & 0xF) << 4)
    hi2 = s >> 4
    sc[:, 8:12] = hi2[:, 0:4] | (hi2[:, 4:8] << 2) | (hi2[:, 8:12] << 4) | (hi2[:, 12:16] << 6)
    return sc


# ----------------------------------------------------------------------------- Q4_K / Q5_K

def _scales_mins_k4(x: np.ndarray, qw: np.ndarray | None, nmax: int, rmin: float, nstep: int):
    """Shared Q4_K/Q5_K search: returns (L, ls, lm, d_h, d, m_h, dm) before the final requantization."""
    if qw is None:
        sum_x2 = seq_sum(x * x)
        av_x = np.sqrt(sum_x2 / f32(32))
        w = av_x[None] + np.abs(x)
        scales, mins, L = make_qkx_quants(x, w, nmax, rmin, 0.1, nstep, False)
        max_scale = _pos_max(scales)
        max_min = _pos_max(mins)
        inv_s = np.where(max_scale > 0, f32(63) / np.where(max_scale > 0, max_scale, f32(1)), f32(0))
        inv_m = np.where(max_min > 0, f32(63) / np.where(max_min > 0, max_min, f32(1)), f32(0))
        ls = np.minimum(63, nearest_int(inv_s[None] * scales) & 0xFF)
        lm = np.minimum(63, nearest_int(inv_m[None] * mins) & 0xFF)
        d_h, d = fp16_round(max_scale / f32(63))
        m_h, dm = fp16_round(max_min / f32(63))
    else:
        sigma2 = _sigma2(x, 2)
        w = _subblocks(qw, 32) * np.sqrt(sigma2[None, None] + x * x)
        sw = seq_sum(w)
        scales, mins, L = make_qkx_quants(x, w, nmax, -0.9, 0.05, 36, False)
        d_block, ls = make_qp_quants(scales, 63, sw)
        m_block, lm = make_qp_quants(mins, 63, sw)
        ls = np.minimum(63, ls.astype(np.int32))
        lm = np.minimum(63, lm.astype(np.int32))
        d_h, d = fp16_round(d_block)
        m_h, dm = fp16_round(m_block)
    dsub = d[None] * ls.astype(F32)
    msub = dm[None] * lm.astype(F32)
    L = _flat(_requant(x, L, dsub, 0, nmax, msub))
    return L, ls, lm, d_h, m_h


def pack_scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins (each (8, S)) -> (S, 12) in get_scale_min_k4 order."""
    s = ls.T.astype(np.uint8)
    m = lm.T.astype(np.uint8)
    out = np.empty((s.shape[0], 12), np.uint8)
    out[:, 0:4] = (s[:, 0:4] & 63) | ((s[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (s[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def encode_q4_k(xs: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """Q4_K: 8 sub-blocks of 32, 4-bit levels, 6-bit scale and min each (144 bytes)."""
    x = _subblocks(xs, 32)
    L, ls, lm, d_h, m_h = _scales_mins_k4(x, qw, 15, -1.0, 20)
    S = xs.shape[0]
    q = L.reshape(S, 4, 2, 32)
    out = np.empty((S, 144), np.uint8)
    out[:, 0:2] = _f16_bytes(d_h)
    out[:, 2:4] = _f16_bytes(m_h)
    out[:, 4:16] = pack_scales_k4(ls, lm)
    out[:, 16:144] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(S, 128)
    return out


def encode_q5_k(xs: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """Q5_K: as Q4_K with 5-bit levels (high bits in qh) (176 bytes)."""
    x = _subblocks(xs, 32)
    L, ls, lm, d_h, m_h = _scales_mins_k4(x, qw, 31, -0.5, 15)
    S = xs.shape[0]
    q = L.reshape(S, 4, 2, 32)  # chunk c, half, l
    hb = (q >> 4).astype(np.uint8)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, :, None]
    qh = np.bitwise_or.reduce((hb[:, :, 0] << shifts) | (hb[:, :, 1] << (shifts + 1)), axis=1)
    lo = q & 0xF
    out = np.empty((S, 176), np.uint8)
    out[:, 0:2] = _f16_bytes(d_h)
    out[:, 2:4] = _f16_bytes(m_h)
    out[:, 4:16] = pack_scales_k4(ls, lm)
    out[:, 16:48] = qh
    out[:, 48:176] = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(S, 128)
    return out


# ----------------------------------------------------------------------------- Q6_K

def encode_q6_k(xs: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """Q6_K: 16 sub-blocks of 16, 6-bit levels, int8 scales (210 bytes); qw used raw as weights."""
    x = _subblocks(xs, 16)
    scales, L = make_qx_quants(x, 32, None if qw is None else _subblocks(qw, 16))
    max_abs, max_scale = first_absmax(scales)
    zero = max_abs < GROUP_MAX_EPS
    iscale = f32(-128) / np.where(zero, f32(1), max_scale)
    d_h, d = fp16_round(f32(1) / iscale)
    sc = np.minimum(127, nearest_int(iscale[None] * scales)).astype(np.int8)
    dsub = d[None] * sc.astype(F32)
    L = _flat(_requant(x, L, dsub, -32, 31))
    S = xs.shape[0]
    q = L.reshape(S, 2, 4, 32)  # half, quarter, l
    out = np.empty((S, 210), np.uint8)
    ql = np.empty((S, 2, 64), np.uint8)
    ql[:, :, 0:32] = (q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4)
    ql[:, :, 32:64] = (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)
    h = q >> 4
    qh = h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)
    out[:, 0:128] = ql.reshape(S, 128)
    out[:, 128:192] = qh.reshape(S, 64)
    out[:, 192:208] = sc.T.view(np.uint8)
    out[:, 208:210] = _f16_bytes(d_h)
    out[zero] = 0
    return out
