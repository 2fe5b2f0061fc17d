"""ggml's 32-weight legacy types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) in torch, bit-exact with ggml on any device.

Without an importance matrix these follow ggml's reference quantizers (``quantize_row_*_ref``); with
one, the importance-weighted search whose weights use sigma2 = mean(x^2) over the whole row (Q8_0
ignores it). Each encoder takes rows x float32 (R, n) and importance qw (R, n) or None and returns uint8
(R, n/32*block_bytes) on x's device. ggml's float -> int8/uint8 casts are reproduced as x86 does
them (truncation to int32, then the low byte; INT_MIN for NaN and infinities).
"""
from __future__ import annotations

import torch

from mixq.quant.ggml.k_quants.torch_search import (div_by, first_absmax, first_min, fp16_bits, half_bytes,
                                                   make_qkx_quants, make_qx_quants, rdiv, seq_sum, sqrt, to_int32)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """(R, n) -> (32, R*n/32): element, block."""
    return x.reshape(-1, 32).T.contiguous()


def _weights(x: torch.Tensor, xb: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """ggml's weights qw * sqrt(sigma2_row + x^2) of the blocks xb, sigma2 summed in column order.

    qw (R, n): each row's importance.
    """
    R, n = x.shape
    xt = x.T.contiguous()
    sigma2 = div_by(seq_sum(xt * xt), float(n)).repeat_interleave(n // 32)
    return _blocks(qw) * sqrt(sigma2 + xb * xb)


def _low_byte(v: torch.Tensor) -> torch.Tensor:
    """C's (int8_t)/(uint8_t) cast of a float on x86: int32 truncation, then the low byte (int32 0..255)."""
    return to_int32(v) & 0xFF


def _as_int8(b: torch.Tensor) -> torch.Tensor:
    """Low byte (0..255) -> its int8 value (-128..127) as int32."""
    return ((b ^ 0x80) - 0x80)


def _first_max(x: torch.Tensor) -> torch.Tensor:
    """Maximum along dim 0 as a strict '>' scan from x[0] finds it (a zero keeps its first sign)."""
    return -first_min(-x)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """d ? 1/d : 0."""
    return torch.where(d != 0, rdiv(1.0, torch.where(d != 0, d, 1.0)), 0.0)


def _nibbles(L: torch.Tensor) -> torch.Tensor:
    """(32, B) levels -> (B, 16): byte j = L[j] low | L[j+16] high (low 4 bits of each)."""
    Lt = L.T
    return ((Lt[:, :16] & 0xF) | ((Lt[:, 16:] & 0xF) << 4)).to(torch.uint8)


def _qh(L: torch.Tensor) -> torch.Tensor:
    """(32, B) 5-bit levels -> (B, 4): little-endian uint32 of the fifth bits (bit j for element j)."""
    bits = ((L.T.to(torch.int64) >> 4) & 1) << torch.arange(32, device=L.device)
    v = bits.sum(1)
    return torch.stack([(v >> (8 * i)) & 0xFF for i in range(4)], dim=1).to(torch.uint8)


def _rows(parts: list[torch.Tensor], R: int) -> torch.Tensor:
    return torch.cat(parts, dim=1).reshape(R, -1)


def roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: nearest integer, halves away from zero."""
    t = torch.trunc(v)
    return t + torch.where(torch.abs(v - t) >= 0.5, torch.sign(v), 0.0)


def encode_q8_0(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """Q8_0 (34 bytes per block): d = amax/127, q = roundf(x/d); ggml ignores the imatrix."""
    xb = _blocks(x)
    amax = torch.clamp_min(torch.abs(xb).amax(0), 0.0)
    d = div_by(amax, 127.0)
    q = _low_byte(roundf(xb * _inverse(d)))
    return _rows([half_bytes(fp16_bits(d)[0]), q.T.to(torch.uint8)], x.shape[0])


def _symmetric_ref(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0/Q5_0 reference: d = max/-nmax (max = the first largest-|x| value), levels (32, B) in [0, 2*nmax)."""
    xb = _blocks(x)
    _, mx = first_absmax(xb)
    d = div_by(mx, -float(nmax))
    v = _as_int8(_low_byte(xb * _inverse(d) + (nmax + 0.5)))
    return d, torch.clamp_max(v, 2 * nmax - 1) & 0xFF, xb


def _affine_ref(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1/Q5_1 reference: d = (max - min)/nmax, m = min, levels (x - min)/d + 0.5 truncated."""
    xb = _blocks(x)
    mn, mx = first_min(xb), _first_max(xb)
    d = div_by(mx - mn, float(nmax))
    v = _low_byte((xb - mn) * _inverse(d) + 0.5)
    if nmax == 15:  # Q4_1 clamps through int8; Q5_1 casts straight to uint8
        v = torch.clamp_max(_as_int8(v), 15) & 0xFF
    return d, mn, v


def encode_q4_0(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """Q4_0 (18 bytes per block): symmetric 4-bit levels; with importance ggml's weighted search."""
    if qw is None:
        d, L, _ = _symmetric_ref(x, 8)
    else:
        xb = _blocks(x)
        d, L = make_qx_quants(xb, 8, _weights(x, xb, qw))
    return _rows([half_bytes(fp16_bits(d)[0]), _nibbles(L)], x.shape[0])


def encode_q5_0(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """Q5_0 (22 bytes per block): symmetric 5-bit levels, fifth bits in qh."""
    if qw is None:
        d, L, _ = _symmetric_ref(x, 16)
    else:
        xb = _blocks(x)
        d, L = make_qx_quants(xb, 16, _weights(x, xb, qw))
    return _rows([half_bytes(fp16_bits(d)[0]), _qh(L), _nibbles(L)], x.shape[0])


def encode_q4_1(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """Q4_1 (20 bytes per block): 4-bit levels with scale d and offset m."""
    if qw is None:
        d, m, L = _affine_ref(x, 15)
    else:
        xb = _blocks(x)
        d, the_min, L = make_qkx_quants(xb, _weights(x, xb, qw), 15, -0.9, 0.05, 36, False)
        m = -the_min
    return _rows([half_bytes(fp16_bits(d)[0]), half_bytes(fp16_bits(m)[0]), _nibbles(L)], x.shape[0])


def encode_q5_1(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """Q5_1 (24 bytes per block): 5-bit levels with scale d and offset m, fifth bits in qh."""
    if qw is None:
        d, m, L = _affine_ref(x, 31)
    else:
        xb = _blocks(x)
        d, the_min, L = make_qkx_quants(xb, _weights(x, xb, qw), 31, -0.9, 0.05, 36, False)
        m = -the_min
    return _rows([half_bytes(fp16_bits(d)[0]), half_bytes(fp16_bits(m)[0]), _qh(L), _nibbles(L)], x.shape[0])
