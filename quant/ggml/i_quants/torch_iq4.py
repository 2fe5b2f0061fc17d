"""IQ4_XS and IQ4_NL encoders in torch (non-linear 16-level grid, 32-weight blocks), bit-exact with ggml.

Same search as :mod:`numpy_iq4` (which documents it). ``encode_iq4_xs(xs, qw)`` takes super-blocks
(S, 256) and importance (S, 256) or None; ``encode_iq4_nl(x, qw)`` takes rows (R, n) and their importance
(R, n) or None. Both return uint8 blocks on the input's device.
"""
from __future__ import annotations

import torch

from mixq.quant.ggml.i_quants.numpy_iq4 import IQ4_LEVELS
from mixq.quant.ggml.k_quants.torch_search import (F32, GROUP_MAX_EPS, div_by, first_absmax, fp16_bits, half_bytes,
                                                   nearest_int, rdiv, seq_sum, sqrt)


def grid_values(device: torch.device) -> torch.Tensor:
    """The 16 IQ4 levels (kvalues_iq4nl) as float32 on ``device``."""
    return torch.as_tensor(IQ4_LEVELS, dtype=F32).to(device)


def best_index(a: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Nearest grid index of each value, int64 (ggml best_index_int8: ties go to the upper level, NaN to 15)."""
    mu = torch.clamp(torch.bucketize(a, values, right=True), 1, 15)   # values[mu-1] <= a < values[mu]
    lo, hi = values[mu - 1], values[mu]
    idx = torch.where(a - lo < hi - a, mu - 1, mu)
    idx = torch.where(a <= values[0], 0, idx)
    return torch.where((a >= values[15]) | torch.isnan(a), 15, idx)


def block_scales(x: torch.Tensor, w: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """ggml's per-32 scale search: x, w (32, ...) -> signed scale (...), 0 for all-zero blocks."""
    amax, mx = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = torch.where(zero, 1.0, mx)

    def sums(inv):
        qv = values[best_index(inv * x, values)]
        wq = w * qv
        return seq_sum(wq * x), seq_sum(wq * qv)

    d = div_by(-mx, -127.0)
    sumqx, sumq2 = sums(rdiv(1.0, d))
    d = torch.where(sumq2 > 0, sumqx / sumq2, 0.0)
    best = d * sumqx
    for itry in range(-7, 8):
        sumqx, sumq2 = sums(rdiv(float(itry - 127), mx))
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = torch.where(better, sumqx / sumq2, d)
        best = torch.where(better, d * sumqx, best)
    return torch.where(zero, 0.0, d)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """d ? 1/d : 0."""
    return torch.where(d != 0, rdiv(1.0, torch.where(d != 0, d, 1.0)), 0.0)


def _nibbles(L: torch.Tensor) -> torch.Tensor:
    """(..., 32) levels -> (..., 16) bytes: element j low, element j+16 high."""
    return (L[..., :16] | (L[..., 16:] << 4)).to(torch.uint8)


def encode_iq4_xs(xs: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """IQ4_XS blocks (136 bytes) of super-blocks xs (S, 256); qw (S, 256) optional importance."""
    S = xs.shape[0]
    values = grid_values(xs.device)
    x = xs.reshape(S, 8, 32).permute(2, 1, 0).contiguous()   # (element, block, super-block)
    xe = xs.T.contiguous()
    sigma2 = seq_sum(xe * xe) * (2.0 / 256.0)
    if qw is None:
        w = x * x
    else:
        w = qw.reshape(S, 8, 32).permute(2, 1, 0) * sqrt(sigma2 + x * x)
    scales = block_scales(x, w, values)                        # (8, S)
    _, max_scale = first_absmax(scales)
    dsup = div_by(-max_scale, 32.0)
    d_h, _ = fp16_bits(dsup)
    ls = torch.clamp(nearest_int(_inverse(dsup) * scales), -32, 31)
    dl = dsup * ls.to(F32)  # the unrounded super-block scale, as ggml uses it here
    L = best_index(_inverse(dl) * x, values)                   # (32, 8, S)
    l6 = (ls + 32).T.to(torch.int64)                           # (S, 8)
    sh = ((l6 >> 4) << (2 * torch.arange(8, device=xs.device))).sum(1)
    lo = l6 & 0xF
    return torch.cat([half_bytes(d_h), (sh & 0xFF)[:, None].to(torch.uint8), (sh >> 8)[:, None].to(torch.uint8),
                      (lo[:, 0::2] | (lo[:, 1::2] << 4)).to(torch.uint8),
                      _nibbles(L.permute(2, 1, 0)).reshape(S, 128)], dim=1)


def encode_iq4_nl(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """IQ4_NL rows (R, n/32*18) of rows x (R, n); qw (R, n) optional importance (one row per row of x)."""
    R, n = x.shape
    values = grid_values(x.device)
    xb = x.reshape(R * (n // 32), 32).T.contiguous()           # (element, block)
    if qw is None:
        w = xb * xb
    else:
        sigma2 = seq_sum(xb * xb) * (2.0 / 32.0)
        w = qw.reshape(-1, 32).T * sqrt(sigma2 + xb * xb)
    d = block_scales(xb, w, values)
    d_h, _ = fp16_bits(d)
    L = best_index(_inverse(d) * xb, values).T                 # (block, element)
    return torch.cat([half_bytes(d_h), _nibbles(L)], dim=1).reshape(R, -1)
