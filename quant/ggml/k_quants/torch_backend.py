"""Q2_K … Q6_K super-block encoders (256 weights per block) in torch, bit-exact with ggml on any device.

Each ``encode_qN_k(xs, qw)`` takes super-blocks ``xs`` float32 (S, 256) and optional per-element
importance ``qw`` (S, 256) on one device and returns uint8 (S, block_bytes) there. ``qw is None``
follows ggml's reference quantizer (``quantize_row_*_ref``), otherwise its importance-weighted
path (``quantize_row_*_impl``). The steps are public so that other encoders of these block formats
can reuse them: :func:`subblocks` (layout), the searches of :mod:`torch_search`,
:func:`requantize` (levels from the stored scales) and the ``pack_*`` functions (bytes).
"""
from __future__ import annotations

import torch

from mixq.quant.ggml.k_quants.torch_search import (F32, GROUP_MAX_EPS, div_by, first_absmax, fp16_bits, half_bytes,
                                                   make_q3_quants, make_qkx_quants, make_qp_quants, make_qx_quants,
                                                   nearest_int, pos_max, rdiv, seq_sum, sqrt)


def subblocks(xs: torch.Tensor, m: int) -> torch.Tensor:
    """(S, 256) -> (m, 256/m, S) contiguous: element inside the sub-block, sub-block, super-block."""
    S = xs.shape[0]
    return xs.reshape(S, 256 // m, m).permute(2, 1, 0).contiguous()


def flat_levels(L: torch.Tensor) -> torch.Tensor:
    """(m, 256/m, S) levels -> (S, 256) int32 in element order."""
    return L.permute(2, 1, 0).reshape(L.shape[2], 256)


def sigma2(x_sub: torch.Tensor, factor: int) -> torch.Tensor:
    """factor * sum(x^2) / 256 over each super-block (S,), summed in element order."""
    m, nsub, S = x_sub.shape
    x = x_sub.permute(1, 0, 2).reshape(256, S).contiguous()
    sumx2 = seq_sum(x * x)
    return div_by(sumx2 * float(factor) if factor != 1 else sumx2, 256.0)


def importance_weights(x_sub: torch.Tensor, qw: torch.Tensor, factor: int) -> torch.Tensor:
    """ggml's weights qw * sqrt(sigma2 + x^2) in the sub-block layout of x_sub."""
    s2 = sigma2(x_sub, factor)
    return subblocks(qw, x_sub.shape[0]) * sqrt(s2 + x_sub * x_sub)


def requantize(x: torch.Tensor, L: torch.Tensor, dsub: torch.Tensor, lo: int, hi: int,
               offset: torch.Tensor | None = None) -> torch.Tensor:
    """Final levels with the stored (fp16-rounded) scales; sub-blocks whose scale is 0 keep L.

    Levels are clamp(nearest_int((x + offset) / dsub), lo, hi), shifted to start at 0.
    """
    num = x if offset is None else x + offset
    lev = torch.clamp(nearest_int(num / dsub), lo, hi)
    return torch.where(dsub != 0, lev - lo if lo < 0 else lev, L)


def pack_2bit(L: torch.Tensor) -> torch.Tensor:
    """(S, 256) 2-bit levels -> (S, 64): byte 32h+l holds L[128h+l+32k] at bits 2k."""
    q = L.reshape(-1, 2, 4, 32)
    out = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return out.reshape(-1, 64).to(torch.uint8)


def _u8(a: torch.Tensor) -> torch.Tensor:
    return a.to(torch.uint8)


# ----------------------------------------------------------------------------- Q2_K

def encode_q2_k(xs: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """Q2_K: 16 sub-blocks of 16, 2-bit levels, 4-bit scale and min per sub-block (84 bytes)."""
    x = subblocks(xs, 16)
    if qw is None:
        scales, mins, L = make_qkx_quants(x, torch.abs(x), 3, -0.5, 0.1, 15, True)
        max_scale, max_min = pos_max(scales), pos_max(mins)
        has_s, has_m = max_scale > 0, max_min > 0
        ls = nearest_int(rdiv(15.0, torch.where(has_s, max_scale, 1.0)) * scales)
        lm = nearest_int(rdiv(15.0, torch.where(has_m, max_min, 1.0)) * mins)
        byte = torch.where(has_s, ls & 0xFF, 0) | torch.where(has_m, (lm << 4) & 0xFF, 0)
        d_h, d = fp16_bits(torch.where(has_s, div_by(max_scale, 15.0), 0.0))
        m_h, dm = fp16_bits(torch.where(has_m, div_by(max_min, 15.0), 0.0))
    else:
        s2 = sigma2(x, 1)
        w = subblocks(qw, 16) * sqrt(s2 + x * x)
        sw = seq_sum(w)
        scales, mins, L = make_qkx_quants(x, w, 3, -0.9, 0.05, 36, False)
        dmv, Ls = make_qp_quants(scales, 15, sw)
        mmv, Lm = make_qp_quants(mins, 15, sw)
        d_h, d = fp16_bits(dmv)
        m_h, dm = fp16_bits(mmv)
        byte = (Ls | (Lm << 4)) & 0xFF
    dsub = d * (byte & 0xF).to(F32)
    msub = dm * (byte >> 4).to(F32)
    L = flat_levels(requantize(x, L, dsub, 0, 3, msub))
    return torch.cat([_u8(byte.T), pack_2bit(L), half_bytes(d_h), half_bytes(m_h)], dim=1)


# ----------------------------------------------------------------------------- Q3_K

def pack_q3_k(L: torch.Tensor, l6: torch.Tensor, d_h: torch.Tensor) -> torch.Tensor:
    """Q3_K bytes from levels (S, 256) in [0, 8), 6-bit biased scales (16, S) and fp16 bits (S,)."""
    S = L.shape[0]
    high = L > 3
    L = torch.where(high, L - 4, L)
    # element j: bit j//32 of hmask[j%32]
    shifts = torch.arange(8, device=L.device, dtype=torch.int32)[None, :, None]
    hmask = (high.reshape(S, 8, 32).to(torch.int32) << shifts).sum(1)
    return torch.cat([_u8(hmask), pack_2bit(L), pack_scales_q3_k(l6.T), half_bytes(d_h)], dim=1)


def pack_scales_q3_k(l6: torch.Tensor) -> torch.Tensor:
    """16 six-bit scales per block, stored +32 ((S, 16), 0..63) -> (S, 12): low nibbles two per byte, then the
    high 2-bit pairs four per byte."""
    low = (l6[:, 0:8] & 0xF) | ((l6[:, 8:16] & 0xF) << 4)
    hi2 = l6 >> 4
    return _u8(torch.cat([low, hi2[:, 0:4] | (hi2[:, 4:8] << 2) | (hi2[:, 8:12] << 4) | (hi2[:, 12:16] << 6)], 1))


def encode_q3_k(xs: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """Q3_K: 16 sub-blocks of 16, 3-bit levels (2 low bits + hmask), 6-bit signed scales (110 bytes)."""
    x = subblocks(xs, 16)
    if qw is None:
        scales, L = make_q3_quants(x, 4)
        _, max_scale = first_absmax(scales)
        nz = max_scale != 0
        iscale = rdiv(-32.0, torch.where(nz, max_scale, 1.0))
        l6 = torch.clamp(nearest_int(iscale * scales).to(torch.int8), -32, 31).to(torch.int32) + 32
        l6 = torch.where(nz, l6, 0)
        d_h, d = fp16_bits(torch.where(nz, rdiv(1.0, iscale), 0.0))
    else:
        s2 = sigma2(x, 2)
        w = subblocks(qw, 16) * sqrt(s2 + x * x)
        sw = seq_sum(w)
        scales, L = make_qx_quants(x, 4, w)
        d_block, l6 = make_qx_quants(scales, 32, sw)
        d_h, d = fp16_bits(d_block)
    dsub = d * (l6 - 32).to(F32)
    L = flat_levels(requantize(x, L, dsub, -4, 3))
    return pack_q3_k(L, l6, d_h)


# ----------------------------------------------------------------------------- Q4_K / Q5_K

def scales_mins_k4(x: torch.Tensor, qw: torch.Tensor | None, nmax: int, rmin: float, nstep: int):
    """Shared Q4_K/Q5_K search on x (32, 8, S): returns (levels (S, 256), 6-bit scales (8, S), 6-bit
    mins (8, S), fp16 bits of d (S,), fp16 bits of dmin (S,))."""
    if qw is None:
        av_x = sqrt(div_by(seq_sum(x * x), 32.0))
        w = av_x + torch.abs(x)
        scales, mins, L = make_qkx_quants(x, w, nmax, rmin, 0.1, nstep, False)
        max_scale, max_min = pos_max(scales), pos_max(mins)
        inv_s = torch.where(max_scale > 0, rdiv(63.0, torch.where(max_scale > 0, max_scale, 1.0)), 0.0)
        inv_m = torch.where(max_min > 0, rdiv(63.0, torch.where(max_min > 0, max_min, 1.0)), 0.0)
        ls = torch.clamp_max(nearest_int(inv_s * scales) & 0xFF, 63)
        lm = torch.clamp_max(nearest_int(inv_m * mins) & 0xFF, 63)
        d_h, d = fp16_bits(div_by(max_scale, 63.0))
        m_h, dm = fp16_bits(div_by(max_min, 63.0))
    else:
        w = importance_weights(x, qw, 2)
        sw = seq_sum(w)
        scales, mins, L = make_qkx_quants(x, w, nmax, -0.9, 0.05, 36, False)
        d_block, ls = make_qp_quants(scales, 63, sw)
        m_block, lm = make_qp_quants(mins, 63, sw)
        ls, lm = torch.clamp_max(ls, 63), torch.clamp_max(lm, 63)
        d_h, d = fp16_bits(d_block)
        m_h, dm = fp16_bits(m_block)
    dsub = d * ls.to(F32)
    msub = dm * lm.to(F32)
    L = flat_levels(requantize(x, L, dsub, 0, nmax, msub))
    return L, ls, lm, d_h, m_h


def pack_scales_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """8 six-bit scales and mins (each (8, S)) -> (S, 12) in get_scale_min_k4 order."""
    s, m = ls.T, lm.T
    return _u8(torch.cat([(s[:, 0:4] & 63) | ((s[:, 4:8] >> 4) << 6),
                          (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6),
                          (s[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)], dim=1))


def encode_q4_k(xs: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """Q4_K: 8 sub-blocks of 32, 4-bit levels, 6-bit scale and min each (144 bytes)."""
    L, ls, lm, d_h, m_h = scales_mins_k4(subblocks(xs, 32), qw, 15, -1.0, 20)
    S = xs.shape[0]
    q = L.reshape(S, 4, 2, 32)
    nib = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(S, 128)
    return torch.cat([half_bytes(d_h), half_bytes(m_h), pack_scales_k4(ls, lm), _u8(nib)], dim=1)


def encode_q5_k(xs: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """Q5_K: as Q4_K with 5-bit levels (high bits in qh) (176 bytes)."""
    L, ls, lm, d_h, m_h = scales_mins_k4(subblocks(xs, 32), qw, 31, -0.5, 15)
    S = xs.shape[0]
    q = L.reshape(S, 4, 2, 32)  # chunk c, half, l
    hb = q >> 4
    shifts = (2 * torch.arange(4, device=xs.device, dtype=torch.int32))[None, :, None]
    qh = ((hb[:, :, 0] << shifts) | (hb[:, :, 1] << (shifts + 1))).sum(1)  # disjoint bits: sum is OR
    lo = q & 0xF
    nib = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(S, 128)
    return torch.cat([half_bytes(d_h), half_bytes(m_h), pack_scales_k4(ls, lm), _u8(qh), _u8(nib)], dim=1)


# ----------------------------------------------------------------------------- Q6_K

def encode_q6_k(xs: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """Q6_K: 16 sub-blocks of 16, 6-bit levels, int8 scales (210 bytes); qw used raw as weights."""
    x = subblocks(xs, 16)
    scales, L = make_qx_quants(x, 32, None if qw is None else subblocks(qw, 16))
    max_abs, max_scale = first_absmax(scales)
    zero = max_abs < GROUP_MAX_EPS
    iscale = rdiv(-128.0, torch.where(zero, 1.0, max_scale))
    d_h, d = fp16_bits(rdiv(1.0, iscale))
    sc = torch.clamp_max(nearest_int(iscale * scales), 127).to(torch.int8)
    dsub = d * sc.to(F32)
    L = flat_levels(requantize(x, L, dsub, -32, 31))
    S = xs.shape[0]
    q = L.reshape(S, 2, 4, 32)  # half, quarter, l
    ql = torch.cat([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                    (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], dim=2)
    h = q >> 4
    qh = h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)
    out = torch.cat([_u8(ql.reshape(S, 128)), _u8(qh.reshape(S, 64)), sc.T.to(torch.uint8), half_bytes(d_h)],
                    dim=1)
    return torch.where(zero[:, None], 0, out).to(torch.uint8)
