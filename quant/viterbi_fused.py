"""Fused tail-biting Viterbi on CUDA: one Triton program per tile runs all 256 trellis steps of a pass.

Same trellis and two-pass tail-biting scheme as quant/viterbi.py (reference §3.6), organised for a GPU:

* The 65,536 codebook values are loaded once per program into registers as fp16 (128 KB: an fp32 table
  would fill the whole register file), viewed as (U, EH, EL) = (top D bits, middle 16-2D bits, low D bits)
  of the state, so the 2^D candidates of an edge and the 2^D edges sharing a predecessor sit in one thread.
* Edge costs stay on chip across the steps (registers, exchanged through shared memory once per step) in
  fp16, renormalised every ``RENORM_EVERY`` steps (subtracting the running minimum keeps them small, where
  fp16 is precise).
* Each step writes its argmin choices packed, D bits per edge (1 byte per edge from D = 5 up), to global
  memory; a second kernel traces all tiles back at once, one thread per tile.

Pass 1 starts free at position 128, runs once round the ring and traces back to position 0: that picks the
seam edge (the high 16-D bits of s_0, = the low bits of s_255). Pass 2 runs 0..255 from that edge and ends on
it, so the ring is self-consistent by construction. Half rates (1.5, 2.5, 3.5: D(p) = ⌊K⌋ + (p odd)) run
``_forward_half_src``: two steps per iteration, the edge costs of a step indexed by the low 16 − D(p+1) bits of
its state, so the even and odd steps see the codebook as (2^B, M, 2^A) and (2^A, M, 2^B) (A = ⌊K⌋, B = A + 1).
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

NSTATES = 65536
RENORM_EVERY = 16
# Backpointer budget per launch group; a tile needs 256 rows of (65536 >> D) · D / 8 bytes (1 MB at D = 2).
MAX_BP_BYTES = 4 << 30
# One program per SM: the fp16 codebook alone takes half the register file. 8 warps of 255 registers hold
# 256 states per thread without spills at K ≤ 4 (sm_90 SASS: ~4 instructions per state and step); 32 warps
# of 64 registers spill.
NUM_WARPS = 8


HALF_RATES = (1.5, 2.5, 3.5)


def supported(bits: float) -> bool:
    """Whether the fused kernel handles this bitrate (integer K 1..8, or 1.5/2.5/3.5)."""
    return (float(bits) == int(bits) and 1 <= int(bits) <= 8) or float(bits) in HALF_RATES


def bp_layout(d: int) -> tuple[torch.dtype, int]:
    """Backpointer storage of one step: (element dtype, elements per row). D ≤ 4 packs the 2^D edges that
    share their middle bits into one element (D bits each); D ≥ 5 stores one byte per edge."""
    eh = 1 << (16 - 2 * d)
    if d <= 2:
        return torch.uint8, eh
    if d == 3:
        return torch.int32, eh
    if d == 4:
        return torch.int64, eh
    return torch.uint8, NSTATES >> d


def _forward_src(x_ptr, table_ptr, bp_ptr, seam_ptr, final_ptr, D: tl.constexpr, FREE: tl.constexpr,
                 RENORM: tl.constexpr):
    """One pass of one tile. FREE: pass 1 (positions 128..255, 0..127, free start, backpointers kept for
    positions < 128, writes the cheapest final edge); else pass 2 (0..255, starts on the tile's seam edge)."""
    U: tl.constexpr = 1 << D
    EH: tl.constexpr = 1 << (16 - 2 * D)
    NE: tl.constexpr = 1 << (16 - D)
    t = tl.program_id(0).to(tl.int64)
    # c[u, eh, el] = codebook(state (u << 16-D) | (eh << D) | el): the flat table read in state order
    c = tl.load(table_ptr + tl.arange(0, 65536)).reshape(U, EH, U)
    iu = tl.arange(0, U)[:, None, None]
    j = tl.arange(0, NE).reshape(U, EH)  # predecessor edge index (u << 16-2D) | eh
    if FREE:
        old = tl.zeros((U, EH), tl.float16)
        offset = 128
    else:
        seam = tl.load(seam_ptr + t)
        old = tl.where(j == seam, 0.0, float("inf")).to(tl.float16)
        offset = 0
    if D <= 4:
        shifts = (tl.arange(0, U) * D)[None, :]
        row = tl.arange(0, EH)
    else:
        row = tl.arange(0, NE).reshape(EH, U)
    for i in range(256):
        p = (i + offset) & 255
        x = tl.load(x_ptr + t * 256 + p).to(tl.float16)
        d = c - x
        cost = old[:, :, None] + d * d
        new = tl.min(cost, axis=0).to(tl.float16)  # (EH, EL): edge e = (eh << D) | el
        arg = tl.max(tl.where(cost == new[None, :, :], iu, 0), axis=0)
        if FREE:
            keep = p < 128
        else:
            keep = p >= 0
        if D <= 2:
            packed = tl.sum(arg << shifts, axis=1).to(tl.uint8)
            tl.store(bp_ptr + (t * 256 + p) * EH + row, packed, mask=keep)
        elif D == 3:
            packed = tl.sum(arg << shifts, axis=1)
            tl.store(bp_ptr + (t * 256 + p) * EH + row, packed, mask=keep)
        elif D == 4:
            packed = tl.sum(arg.to(tl.int64) << shifts.to(tl.int64), axis=1)
            tl.store(bp_ptr + (t * 256 + p) * EH + row, packed, mask=keep)
        else:
            tl.store(bp_ptr + (t * 256 + p) * NE + row, arg.to(tl.uint8), mask=keep)
        old = tl.reshape(new, (U, EH))  # next step's predecessor index = this edge
        if (i % RENORM) == RENORM - 1:
            old = (old - tl.min(old).to(tl.float16)).to(tl.float16)
    if FREE:
        tl.store(final_ptr + t, tl.argmin(tl.reshape(old, (NE,)), axis=0).to(tl.int32))


def _traceback_src(bp_ptr, edge_ptr, out_ptr, seam_out_ptr, T, D: tl.constexpr, LAST: tl.constexpr,
                   WRITE: tl.constexpr, BLOCK: tl.constexpr):
    """Trace BLOCK tiles back from edge_ptr (the low 16-D bits of the state at position LAST) to position 0.
    WRITE: store the 16-bit states (T, 256) int32; else store the seam edge s_0 >> D."""
    U: tl.constexpr = 1 << D
    EH: tl.constexpr = 1 << (16 - 2 * D)
    NE: tl.constexpr = 1 << (16 - D)
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = t < T
    t64 = t.to(tl.int64)
    e = tl.load(edge_ptr + t, mask=mask, other=0)
    for k in range(LAST + 1):
        p = LAST - k
        if D <= 4:
            unit = tl.load(bp_ptr + (t64 * 256 + p) * EH + (e >> D), mask=mask, other=0).to(tl.int64)
            u = ((unit >> ((e & (U - 1)) * D).to(tl.int64)) & (U - 1)).to(tl.int32)
        else:
            u = tl.load(bp_ptr + (t64 * 256 + p) * NE + e, mask=mask, other=0).to(tl.int32)
        s = (u << (16 - D)) | e
        if WRITE:
            tl.store(out_ptr + t64 * 256 + p, s, mask=mask)
        e = s >> D
    if not WRITE:
        tl.store(seam_out_ptr + t, e, mask=mask)


@triton.jit
def _acs_half(old, c, iu, x, RED: tl.constexpr, EL: tl.constexpr, PT: tl.constexpr):
    """One step of a half rate: old (2^RED, M) predecessor costs, c (2^RED, M, 2^EL) codebook view; returns the
    new costs (M · 2^EL,) and the argmins packed RED bits per edge, one PT word per M row."""
    d = c - x
    cost = old[:, :, None] + d * d
    new = tl.min(cost, axis=0).to(tl.float16)
    arg = tl.max(tl.where(cost == new[None, :, :], iu, 0), axis=0)
    shifts = (tl.arange(0, 1 << EL) * RED)[None, :].to(PT)
    packed = tl.sum(arg.to(PT) << shifts, axis=1)
    return tl.reshape(new, ((1 << (16 - EL - RED)) << EL,)), packed


def _forward_half_src(x_ptr, table_ptr, bp_ptr, seam_ptr, final_ptr, A: tl.constexpr, FREE: tl.constexpr,
                      RENORM: tl.constexpr, PT: tl.constexpr):
    """``_forward_src`` for the half rate A + 0.5: even positions carry A new bits, odd ones A + 1."""
    B: tl.constexpr = A + 1
    M: tl.constexpr = 1 << (16 - A - B)
    t = tl.program_id(0).to(tl.int64)
    flat = tl.load(table_ptr + tl.arange(0, 65536))
    c_even = flat.reshape(1 << B, M, 1 << A)  # even p: reduce the top B bits, edges keep the low A bits
    c_odd = flat.reshape(1 << A, M, 1 << B)
    iu_even = tl.arange(0, 1 << B)[:, None, None]
    iu_odd = tl.arange(0, 1 << A)[:, None, None]
    row = tl.arange(0, M)
    if FREE:
        old = tl.zeros((1 << B, M), tl.float16)
        offset = 128
    else:
        seam = tl.load(seam_ptr + t)
        j = tl.arange(0, 1 << (16 - A)).reshape(1 << B, M)
        old = tl.where(j == seam, 0.0, float("inf")).to(tl.float16)
        offset = 0
    for i in range(0, 256, 2):
        p = (i + offset) & 255
        if FREE:
            keep = p < 128
        else:
            keep = p >= 0
        x = tl.load(x_ptr + t * 256 + p).to(tl.float16)
        new, packed = _acs_half(old, c_even, iu_even, x, B, A, PT)
        tl.store(bp_ptr + (t * 256 + p) * M + row, packed, mask=keep)
        x = tl.load(x_ptr + t * 256 + p + 1).to(tl.float16)
        new, packed = _acs_half(tl.reshape(new, (1 << A, M)), c_odd, iu_odd, x, A, B, PT)
        tl.store(bp_ptr + (t * 256 + p + 1) * M + row, packed, mask=keep)
        old = tl.reshape(new, (1 << B, M))
        if (i % RENORM) == RENORM - 2:
            old = (old - tl.min(old).to(tl.float16)).to(tl.float16)
    if FREE:
        tl.store(final_ptr + t, tl.argmin(tl.reshape(old, (1 << (16 - A),)), axis=0).to(tl.int32))


def _traceback_half_src(bp_ptr, edge_ptr, out_ptr, seam_out_ptr, T, A: tl.constexpr, LAST: tl.constexpr,
                        WRITE: tl.constexpr, BLOCK: tl.constexpr):
    """``_traceback_src`` for the half rate A + 0.5 (row p holds D(p+1)-bit fields, 2^D(p) per word)."""
    M: tl.constexpr = 1 << (15 - 2 * A)
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = t < T
    t64 = t.to(tl.int64)
    e = tl.load(edge_ptr + t, mask=mask, other=0)
    for k in range(LAST + 1):
        p = LAST - k
        dp = A + (p & 1)  # D(p)
        dn = 2 * A + 1 - dp  # D(p + 1)
        unit = tl.load(bp_ptr + (t64 * 256 + p) * M + (e >> dp), mask=mask, other=0).to(tl.int64)
        u = ((unit >> ((e & ((1 << dp) - 1)) * dn).to(tl.int64)) & ((1 << dn) - 1)).to(tl.int32)
        s = (u << (16 - dn)) | e
        if WRITE:
            tl.store(out_ptr + t64 * 256 + p, s, mask=mask)
        e = s >> dp
    if not WRITE:
        tl.store(seam_out_ptr + t, e, mask=mask)


@lru_cache(maxsize=None)
def half_kernels():
    """(forward, traceback) Triton kernels of the half rates."""
    return triton.jit(_forward_half_src), triton.jit(_traceback_half_src)


@lru_cache(maxsize=None)
def kernels():
    """(forward, traceback) Triton kernels (Triton's CPU interpreter runs them when TRITON_INTERPRET=1 was set
    before triton was imported: the tests do that in a subprocess)."""
    return triton.jit(_forward_src), triton.jit(_traceback_src)


def encode(x: torch.Tensor, table16: torch.Tensor, bits: float,
           max_bp_bytes: int = MAX_BP_BYTES) -> torch.Tensor:
    """Tail-biting Viterbi of (T, 256) targets (tensor-core order) against an fp16 codebook table (65536,);
    returns (T, 256) int64 states forming consistent rings."""
    if float(bits) in HALF_RATES:
        return _encode_half(x, table16, int(bits), max_bp_bytes)  # A = ⌊K⌋
    d = int(bits)
    fwd, back = kernels()
    x = x.float().contiguous()
    t_all = x.shape[0]
    out = torch.empty(t_all, 256, dtype=torch.int32, device=x.device)
    if t_all == 0:
        return out.long()
    dtype, row = bp_layout(d)
    per_tile = 256 * row * torch.empty((), dtype=dtype).element_size()
    chunk = max(1, min(t_all, max_bp_bytes // per_tile))
    bp = torch.empty(chunk, 256, row, dtype=dtype, device=x.device)
    final = torch.empty(chunk, dtype=torch.int32, device=x.device)
    seam = torch.empty(chunk, dtype=torch.int32, device=x.device)
    warps = NUM_WARPS
    block = 128
    for lo in range(0, t_all, chunk):
        xs = x[lo:lo + chunk]
        n = xs.shape[0]
        os_ = out[lo:lo + n]
        grid_t = (-(-n // block),)
        fwd[(n,)](xs, table16, bp, seam, final, D=d, FREE=True, RENORM=RENORM_EVERY, num_warps=warps)
        back[grid_t](bp, final, os_, seam, n, D=d, LAST=127, WRITE=False, BLOCK=block, num_warps=4)
        fwd[(n,)](xs, table16, bp, seam, final, D=d, FREE=False, RENORM=RENORM_EVERY, num_warps=warps)
        back[grid_t](bp, seam, os_, seam, n, D=d, LAST=255, WRITE=True, BLOCK=block, num_warps=4)
    return out.long()


def _encode_half(x: torch.Tensor, table16: torch.Tensor, a: int, max_bp_bytes: int) -> torch.Tensor:
    """``encode`` for the half rate a + 0.5."""
    fwd, back = half_kernels()
    x = x.float().contiguous()
    t_all = x.shape[0]
    out = torch.empty(t_all, 256, dtype=torch.int32, device=x.device)
    if t_all == 0:
        return out.long()
    dtype = torch.int64 if a == 3 else torch.int32
    pt = tl.int64 if a == 3 else tl.int32
    row = 1 << (15 - 2 * a)
    chunk = max(1, min(t_all, max_bp_bytes // (256 * row * torch.empty((), dtype=dtype).element_size())))
    bp = torch.empty(chunk, 256, row, dtype=dtype, device=x.device)
    final = torch.empty(chunk, dtype=torch.int32, device=x.device)
    seam = torch.empty(chunk, dtype=torch.int32, device=x.device)
    block = 128
    for lo in range(0, t_all, chunk):
        xs = x[lo:lo + chunk]
        n = xs.shape[0]
        os_ = out[lo:lo + n]
        grid_t = (-(-n // block),)
        fwd[(n,)](xs, table16, bp, seam, final, A=a, FREE=True, RENORM=RENORM_EVERY, PT=pt, num_warps=NUM_WARPS)
        back[grid_t](bp, final, os_, seam, n, A=a, LAST=127, WRITE=False, BLOCK=block, num_warps=4)
        fwd[(n,)](xs, table16, bp, seam, final, A=a, FREE=False, RENORM=RENORM_EVERY, PT=pt, num_warps=NUM_WARPS)
        back[grid_t](bp, seam, os_, seam, n, A=a, LAST=255, WRITE=True, BLOCK=block, num_warps=4)
    return out.long()
