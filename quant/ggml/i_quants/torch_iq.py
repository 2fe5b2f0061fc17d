"""IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S encoders in torch, bit-exact with ggml on any device.

The search is :mod:`torch_grid`'s; this module holds each type's parameters and byte
layout. Each ``encode_*(xs, qw)`` takes super-blocks xs float32 (S, 256) and optional importance
qw (S, 256) on one device and returns uint8 (S, block_bytes) there.
"""
from __future__ import annotations

import torch

from mixq.errors import InputError
from mixq.quant.ggml.i_quants.torch_grid import device_codebook, finish, prepare, search
from mixq.quant.ggml.k_quants.torch_search import GROUP_MAX_EPS, f32, half_bytes, make_qp_quants

GROUP_MAX_EPS_IQ2_S = f32(1e-8)
GROUP_MAX_EPS_IQ3_XXS = f32(1e-8)


def _le_bytes(v: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Integers (..., k) -> uint8 (..., k*nbytes) little-endian."""
    v = v.to(torch.int64)
    parts = [(v >> (8 * i)) & 0xFF for i in range(nbytes)]
    return torch.stack(parts, dim=-1).reshape(*v.shape[:-1], -1).to(torch.uint8)


def _nibble_pairs(ls: torch.Tensor) -> torch.Tensor:
    """(S, 2k) 4-bit scales -> (S, k) bytes, even index in the low nibble."""
    return (ls[:, 0::2] | (ls[:, 1::2] << 4)).to(torch.uint8)


def _zero_dead(out: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    return torch.where(dead[:, None], 0, out).to(torch.uint8)


def _search_16(cb, xval, w, waux, eps: float):
    """IQ2_XS / IQ2_S: 16-weight sub-blocks, 19 candidates around max/5. Returns (scale, L, zero)."""
    mx = xval.amax(0)
    zero = mx < eps
    mx = torch.where(zero, 1.0, mx)
    scale, L = search(cb, xval, w, waux, mx, torch.div(mx, mx.new_full((), 5.0)), 9, 0.1, "offgrid")
    return scale, L, zero


def encode_iq2_xxs(xs: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """IQ2_XXS blocks (66 bytes); qw importance is required (as in llama.cpp)."""
    if qw is None:
        raise InputError("IQ2_XXS needs an importance matrix (as in llama.cpp)")
    cb = device_codebook("IQ2_XXS", str(xs.device))
    S = xs.shape[0]
    xval, w, waux, signs = prepare(xs, qw, 32, 1, parity=True)
    zero = xval.amax(0) < GROUP_MAX_EPS
    scale, _ = make_qp_quants(xval, 4, w)         # seeds the candidate range
    eff_max = scale * 3.0
    zero = zero | ~(eff_max > 0)
    scale, L = search(cb, xval, w, waux, torch.where(zero, 1.0, eff_max), scale, 6, 0.1, "all")
    gi, signs, h, ls, dead = finish(cb, scale, L, zero, signs, S, 8, 127)
    gi = gi.reshape(4, S, 8)
    sg = signs.reshape(4, S, 8)
    w0 = gi[0] | (gi[1] << 8) | (gi[2] << 16) | (gi[3] << 24)
    w1 = sg[0] | (sg[1] << 7) | (sg[2] << 14) | (sg[3] << 21) | (ls.to(torch.int64) << 28)
    q = _le_bytes(torch.stack([w0, w1], dim=2).reshape(S, 16), 4)
    return _zero_dead(torch.cat([half_bytes(h), q], dim=1), dead)


def encode_iq2_xs(xs: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """IQ2_XS blocks (74 bytes); qw importance is required (as in llama.cpp)."""
    if qw is None:
        raise InputError("IQ2_XS needs an importance matrix (as in llama.cpp)")
    cb = device_codebook("IQ2_XS", str(xs.device))
    S = xs.shape[0]
    xval, w, waux, signs = prepare(xs, qw, 16, 1, parity=True)
    scale, L, zero = _search_16(cb, xval, w, waux, GROUP_MAX_EPS)
    gi, signs, h, ls, dead = finish(cb, scale, L, zero, signs, S, 16, 127)
    q = (gi | (signs << 9)).reshape(2, S, 16).permute(1, 2, 0).reshape(S, 32)
    out = torch.cat([half_bytes(h), _le_bytes(q, 2), _nibble_pairs(ls)], dim=1)
    # ggml leaves the whole block zero when every scale is
    return _zero_dead(out, dead)


def encode_iq2_s(xs: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """IQ2_S blocks (82 bytes); qw optional importance."""
    cb = device_codebook("IQ2_S", str(xs.device))
    S = xs.shape[0]
    xval, w, waux, signs = prepare(xs, qw, 16, 2, parity=False)
    scale, L, zero = _search_16(cb, xval, w, waux, GROUP_MAX_EPS_IQ2_S)
    gi, signs, h, ls, dead = finish(cb, scale, L, zero, signs, S, 16, 255, d_factor=f32(0.9875))
    gi = gi.reshape(2, S, 16).permute(1, 2, 0).reshape(S, 32)   # group i8 = 2*ib + k
    sg = signs.reshape(2, S, 16).permute(1, 2, 0).reshape(S, 32)
    hi = ((gi >> 8).reshape(S, 8, 4) << (2 * torch.arange(4, device=xs.device))).sum(2)
    out = torch.cat([half_bytes(h), (gi & 255).to(torch.uint8), sg.to(torch.uint8), hi.to(torch.uint8),
                     _nibble_pairs(ls)], dim=1)
    return _zero_dead(out, dead)


def _sub_major(a: torch.Tensor, S: int) -> torch.Tensor:
    """(k, S*8) per-sub-block values -> (S, 8*k) ordered sub-block, then k."""
    k = a.shape[0]
    return a.reshape(k, S, 8).permute(1, 2, 0).reshape(S, 8 * k)


def encode_iq3_xxs(xs: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """IQ3_XXS blocks (98 bytes); qw optional importance."""
    cb = device_codebook("IQ3_XXS", str(xs.device))
    S = xs.shape[0]
    xval, w, waux, signs = prepare(xs, qw, 32, 2, parity=True, plain_weight=True)
    mx = xval.amax(0)
    zero = mx < GROUP_MAX_EPS_IQ3_XXS
    mx = torch.where(zero, 1.0, mx)
    scale, L = search(cb, xval, w, waux, mx, torch.div(mx, mx.new_full((), 15.0)), 15, 0.2, "offgrid")
    gi, signs, h, ls, dead = finish(cb, scale, L, zero, signs, S, 8, 127, d_factor=f32(1.0125))
    sg = signs.reshape(4, S, 8)
    ss = sg[0] | (sg[1] << 7) | (sg[2] << 14) | (sg[3] << 21) | (ls.to(torch.int64) << 28)
    out = torch.cat([half_bytes(h), _sub_major(gi, S).to(torch.uint8), _le_bytes(ss, 4)], dim=1)
    return _zero_dead(out, dead)


def encode_iq3_s(xs: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """IQ3_S blocks (110 bytes); qw optional importance."""
    cb = device_codebook("IQ3_S", str(xs.device))
    S = xs.shape[0]
    xval, w, waux, signs = prepare(xs, qw, 32, 2, parity=False, plain_weight=True)
    mx = xval.amax(0)
    zero = mx == 0
    mx = torch.where(zero, 1.0, mx)
    scale, L = search(cb, xval, w, waux, mx, torch.div(mx, mx.new_full((), 15.0)), 9, 0.2, "all_if_offgrid")
    gi, signs, h, ls, dead = finish(cb, scale, L, zero, signs, S, 8, 255, d_factor=f32(1.033))
    g = _sub_major(gi, S).reshape(S, 8, 8)                        # (S, sub-block, group)
    sg = _sub_major(signs, S).reshape(S, 8, 4)
    # ggml advances its index and sign pointers only past non-zero sub-blocks (the high bits and
    # scales are indexed by sub-block): later sub-blocks move up into the slots of zero ones
    live = ~zero.reshape(S, 8)
    slot = torch.cumsum(live.to(torch.int64), dim=1) - 1
    si, bi = torch.nonzero(live, as_tuple=True)
    lo = torch.zeros((S, 8, 8), dtype=torch.int64, device=xs.device)
    lo[si, slot[si, bi]] = g[si, bi] & 255
    packed_signs = torch.zeros((S, 8, 4), dtype=torch.int64, device=xs.device)
    packed_signs[si, slot[si, bi]] = sg[si, bi]
    qh = ((g >> 8) << torch.arange(8, device=xs.device)).sum(2)
    out = torch.cat([half_bytes(h), lo.reshape(S, 64).to(torch.uint8), qh.to(torch.uint8),
                     packed_signs.reshape(S, 32).to(torch.uint8), _nibble_pairs(ls)], dim=1)
    return _zero_dead(out, dead)
