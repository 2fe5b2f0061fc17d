"""Importance-weighted paths of ggml's 32-weight legacy types (Q4_0, Q4_1, Q5_0, Q5_1).

Without an importance matrix ggml uses its reference quantizers, which gguf-py reproduces; with
one it runs a weighted search per block whose weights use sigma2 = mean(x^2) over the whole row.
Each encoder takes rows x float32 (R, n) and qw float32 (n,) and returns uint8 (R, n/32*bytes).
"""
from __future__ import annotations

import numpy as np

from mixq.quant.ggml.k_quants.numpy_search import f32, fp16_round, make_qkx_quants, make_qx_quants, seq_sum


def _blocks_and_weights(x: np.ndarray, qw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(32, R*n/32) blocks of x and their weights qw*sqrt(sigma2_row + x^2)."""
    R, n = x.shape
    xt = np.ascontiguousarray(x.T)
    sigma2 = seq_sum(xt * xt) / f32(n)  # per row, summed in column order
    xb = np.ascontiguousarray(x.reshape(R * (n // 32), 32).T)
    s2 = np.repeat(sigma2, n // 32)
    q = np.ascontiguousarray(np.broadcast_to(qw.reshape(1, n // 32, 32), (R, n // 32, 32)).reshape(-1, 32).T)
    return xb, q * np.sqrt(s2[None] + xb * xb)


def _f16(h: np.ndarray) -> np.ndarray:
    return h.astype("<f2").view(np.uint8).reshape(-1, 2)


def _nibbles(L: np.ndarray) -> np.ndarray:
    """(32, B) levels -> (B, 16): byte j = L[j] low | L[j+16] high (low 4 bits of each)."""
    Lt = L.T.astype(np.uint8)
    return (Lt[:, :16] & 0xF) | ((Lt[:, 16:] & 0xF) << 4)


def _qh(L: np.ndarray) -> np.ndarray:
    """(32, B) 5-bit levels -> (B, 4) little-endian uint32 of the fifth bits (bit j for element j)."""
    bits = ((L.T.astype(np.uint32) >> 4) & 1) << np.arange(32, dtype=np.uint32)[None]
    return np.bitwise_or.reduce(bits, axis=1).astype("<u4").view(np.uint8).reshape(-1, 4)


def _finish(parts: list[np.ndarray], R: int) -> np.ndarray:
    return np.concatenate(parts, axis=1).reshape(R, -1)


def encode_q4_0(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """Q4_0 with importance: symmetric search (nmax 8); no requantization after fp16."""
    xb, w = _blocks_and_weights(x, qw)
    d, L = make_qx_quants(xb, 8, w)
    return _finish([_f16(fp16_round(d)[0]), _nibbles(L)], x.shape[0])


def encode_q5_0(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """Q5_0 with importance: symmetric search (nmax 16)."""
    xb, w = _blocks_and_weights(x, qw)
    d, L = make_qx_quants(xb, 16, w)
    return _finish([_f16(fp16_round(d)[0]), _qh(L), _nibbles(L)], x.shape[0])


def encode_q4_1(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """Q4_1 with importance: asymmetric search (nmax 15); m stores -the_min."""
    xb, w = _blocks_and_weights(x, qw)
    d, the_min, L = make_qkx_quants(xb, w, 15, -0.9, 0.05, 36, False)
    return _finish([_f16(fp16_round(d)[0]), _f16(fp16_round(-the_min)[0]), _nibbles(L)], x.shape[0])


def encode_q5_1(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """Q5_1 with importance: asymmetric search (nmax 31)."""
    xb, w = _blocks_and_weights(x, qw)
    d, the_min, L = make_qkx_quants(xb, w, 31, -0.9, 0.05, 36, False)
    return _finish([_f16(fp16_round(d)[0]), _f16(fp16_round(-the_min)[0]), _qh(L), _nibbles(L)],
                   x.shape[0])
