"""IQ3_XXS and IQ3_S encoders (256-weight super-blocks, 4-weight lattice codebooks), bit-exact with ggml.

Same search as the IQ2 types (:mod:`numpy_iq2`): each group of 4 weights is |x| ≈ scale·(2l+1)
with l ∈ 0..7 restricted to a codebook of 256 (IQ3_XXS) or 512 (IQ3_S) 4-tuples, off-codebook
tuples snapped to their best neighbour, sub-blocks of 32 weights with 4-bit scales under an fp16
super-block scale. IQ3_XXS keeps 7 sign bits per 8 weights (even parity), IQ3_S all 8. Both accept
a missing importance matrix (weights x², as ggml's reference path).
"""
from __future__ import annotations

import numpy as np

from mixq.quant.ggml.i_quants.numpy_iq2 import codebook, finish, prepare, search
from mixq.quant.ggml.k_quants.numpy_search import F32, f32

GROUP_MAX_EPS_IQ3_XXS = F32(1e-8)


def _sub_major(a: np.ndarray, S: int) -> np.ndarray:
    """(k, S*8) per-sub-block values -> (S, 8*k) ordered sub-block, then k."""
    k = a.shape[0]
    return np.ascontiguousarray(a.reshape(k, S, 8).transpose(1, 2, 0)).reshape(S, 8 * k)


def encode_iq3_xxs(xs: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """IQ3_XXS blocks (98 bytes) of super-blocks xs (S, 256); qw (S, 256) optional importance."""
    cb = codebook("IQ3_XXS")
    S = xs.shape[0]
    _, xval, w, waux, signs = prepare(xs, qw, 32, 2, parity=True, plain_weight=True)
    mx = np.max(xval, axis=0)
    zero = mx < GROUP_MAX_EPS_IQ3_XXS
    mx = np.where(zero, f32(1), mx)
    scale, L = search(cb, xval, w, waux, mx, mx / f32(15), 15, 0.2, "offgrid")
    gi, signs, h, ls, dead = finish(cb, scale, L, zero, signs, S, 8, 127, d_factor=1.0125)
    sg = signs.reshape(4, S, 8).astype(np.uint32)
    ss = sg[0] | (sg[1] << 7) | (sg[2] << 14) | (sg[3] << 21) | (ls.astype(np.uint32) << 28)
    out = np.empty((S, 98), np.uint8)
    out[:, 0:2] = h.astype("<f2").view(np.uint8).reshape(S, 2)
    out[:, 2:66] = _sub_major(gi, S).astype(np.uint8)
    out[:, 66:98] = ss.astype("<u4").view(np.uint8).reshape(S, 32)
    out[dead] = 0
    return out


def encode_iq3_s(xs: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """IQ3_S blocks (110 bytes) of super-blocks xs (S, 256); qw (S, 256) optional importance."""
    cb = codebook("IQ3_S")
    S = xs.shape[0]
    _, xval, w, waux, signs = prepare(xs, qw, 32, 2, parity=False, plain_weight=True)
    mx = np.max(xval, axis=0)
    zero = mx == 0
    mx = np.where(zero, f32(1), mx)
    scale, L = search(cb, xval, w, waux, mx, mx / f32(15), 9, 0.2, "all_if_offgrid")
    gi, signs, h, ls, dead = finish(cb, scale, L, zero, signs, S, 8, 255, d_factor=1.033)
    g = _sub_major(gi, S).reshape(S, 8, 8)                        # (S, sub-block, group)
    sg = _sub_major(signs, S).reshape(S, 8, 4)
    # ggml advances its index and sign pointers only past non-zero sub-blocks (the high bits and
    # scales are indexed by sub-block): later sub-blocks move up into the slots of zero ones
    live = ~zero.reshape(S, 8)
    slot = np.cumsum(live, axis=1) - 1
    si, bi = np.nonzero(live)
    lo = np.zeros((S, 8, 8), np.int64)
    lo[si, slot[si, bi]] = g[si, bi] & 255
    packed_signs = np.zeros((S, 8, 4), np.int64)
    packed_signs[si, slot[si, bi]] = sg[si, bi]
    out = np.empty((S, 110), np.uint8)
    out[:, 0:2] = h.astype("<f2").view(np.uint8).reshape(S, 2)
    out[:, 2:66] = lo.reshape(S, 64).astype(np.uint8)
    out[:, 66:74] = ((g >> 8) << np.arange(8)[None, None]).sum(2).astype(np.uint8)
    out[:, 74:106] = packed_signs.reshape(S, 32).astype(np.uint8)
    out[:, 106:110] = (ls[:, 0::2] | (ls[:, 1::2] << 4)).astype(np.uint8)
    out[dead] = 0
    return out
