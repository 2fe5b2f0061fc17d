"""IQ4_XS and IQ4_NL encoders (non-linear 16-level grid, 32-weight blocks), bit-exact with ggml.

ggml runs the same search with and without an importance matrix (``quantize_iq4_xs`` /
``quantize_iq4_nl``; without one the weights are x^2): per 32-block a scale search over 15
candidate inverse scales on the fixed grid. IQ4_XS then stores 6-bit block scales relative to a
super-block fp16 scale (256 weights); IQ4_NL stores each block's scale as fp16 (32 weights).
"""
from __future__ import annotations

import numpy as np

from mixq.quant.ggml.k_quants.numpy_search import (F32, GROUP_MAX_EPS, f32, first_absmax, fp16_round, nearest_int,
                                                   seq_sum)

# kvalues_iq4nl: the 16 signed levels of IQ4_NL / IQ4_XS
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int32)
_LEVELS_F = IQ4_LEVELS.astype(F32)
_MU_TABLE = np.clip(np.searchsorted(IQ4_LEVELS, np.arange(-128, 115), side="right"), 1, 15)


def best_index(a: np.ndarray) -> np.ndarray:
    """Nearest grid index of each value (ggml best_index_int8: ties go to the upper level)."""
    # mu = number of levels <= a (values[mu-1] <= a < values[mu]); the levels are integers, so
    # it only depends on floor(a): a 243-entry table instead of a binary search per value
    k = np.clip(np.floor(a), -128, 114).astype(np.int32) + 128
    mu = np.take(_MU_TABLE, k, mode="clip")
    lo = _LEVELS_F[mu - 1]
    hi = _LEVELS_F[mu]
    idx = np.where(a - lo < hi - a, mu - 1, mu)
    idx = np.where(a <= _LEVELS_F[0], 0, idx)
    return np.where((a >= _LEVELS_F[15]) | np.isnan(a), 15, idx)


def block_scales(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """ggml's per-32 scale search on the grid: x, w (32, ...) -> signed scale (...), 0 for all-zero blocks.

    Starts at -max/-127 and tries the 15 inverse scales (itry - 127)/max, keeping the best weighted fit.
    """
    amax, mx = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, f32(1), mx)

    def sums(inv):
        qv = _LEVELS_F[best_index(inv * x)]
        wq = w * qv
        return seq_sum(wq * x), seq_sum(wq * qv)

    d = -mx / f32(-127)
    sumqx, sumq2 = sums(f32(1) / d)
    d = np.where(sumq2 > 0, sumqx / sumq2, f32(0))
    best = d * sumqx
    for itry in range(-7, 8):
        sumqx, sumq2 = sums(f32(itry - 127) / mx)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(better, sumqx / sumq2, d)
        best = np.where(better, d * sumqx, best)
    return np.where(zero, f32(0), d)


def encode_iq4_xs(xs: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """IQ4_XS blocks (136 bytes) of super-blocks xs (S, 256); qw (S, 256) optional importance."""
    S = xs.shape[0]
    x = np.ascontiguousarray(xs.reshape(S, 8, 32).transpose(2, 1, 0))  # (element, block, super-block)
    xe = xs.T  # element order within the super-block
    sigma2 = seq_sum(xe * xe) * (f32(2) / f32(256))
    if qw is None:
        w = x * x
    else:
        q = np.ascontiguousarray(qw.reshape(S, 8, 32).transpose(2, 1, 0))
        w = q * np.sqrt(sigma2[None, None] + x * x)
    scales = block_scales(x, w)  # (8, S)

    _, max_scale = first_absmax(scales)
    dsup = -max_scale / f32(32)
    d_h, _ = fp16_round(dsup)
    idsup = np.where(dsup != 0, f32(1) / np.where(dsup != 0, dsup, f32(1)), f32(0))
    ls = np.clip(nearest_int(idsup[None] * scales), -32, 31)
    dl = dsup[None] * ls.astype(F32)  # the unrounded super-block scale, as ggml uses it here
    idl = np.where(dl != 0, f32(1) / np.where(dl != 0, dl, f32(1)), f32(0))
    L = best_index(idl[None] * x).astype(np.uint8)  # (32, 8, S)

    out = np.empty((S, 136), np.uint8)
    out[:, 0:2] = d_h.astype("<f2").view(np.uint8).reshape(S, 2)
    l6 = (ls + 32).T.astype(np.uint16)  # (S, 8)
    sh = np.bitwise_or.reduce((l6 >> 4) << (2 * np.arange(8, dtype=np.uint16))[None], axis=1)
    out[:, 2:4] = sh.astype("<u2").view(np.uint8).reshape(S, 2)
    lo = (l6 & 0xF).astype(np.uint8)
    out[:, 4:8] = lo[:, 0::2] | (lo[:, 1::2] << 4)
    Lt = L.transpose(2, 1, 0)  # (S, block, element)
    out[:, 8:136] = (Lt[:, :, :16] | (Lt[:, :, 16:] << 4)).reshape(S, 128)
    return out


def encode_iq4_nl(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """IQ4_NL blocks (18 bytes per 32 weights) of rows x (R, n); qw (n,) optional importance.

    ggml_quantize_chunk runs the scale search with and without an importance matrix (no-imatrix
    weights are x^2); the block stores the scale as fp16 and the levels are re-rounded with the
    unrounded scale, as ggml does.
    """
    R, n = x.shape
    xb = np.ascontiguousarray(x.reshape(R * (n // 32), 32).T)  # (element, block)
    if qw is None:
        w = xb * xb
    else:
        sigma2 = seq_sum(xb * xb) * (f32(2) / f32(32))
        q = np.ascontiguousarray(np.broadcast_to(qw.reshape(1, n // 32, 32), (R, n // 32, 32)).reshape(-1, 32).T)
        w = q * np.sqrt(sigma2[None] + xb * xb)
    d = block_scales(xb, w)
    d_h, _ = fp16_round(d)
    inv = np.where(d != 0, f32(1) / np.where(d != 0, d, f32(1)), f32(0))
    L = best_index(inv[None] * xb).astype(np.uint8).T  # (block, element)
    out = np.empty((R * (n // 32), 18), np.uint8)
    out[:, 0:2] = d_h.astype("<f2").view(np.uint8).reshape(-1, 2)
    out[:, 2:18] = L[:, :16] | (L[:, 16:] << 4)
    return out.reshape(R, -1)
