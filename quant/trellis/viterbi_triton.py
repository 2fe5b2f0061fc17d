"""Fused tail-biting Viterbi on CUDA: one Triton program per tile runs all 256 trellis steps of a pass.

Same trellis and two-pass tail-biting scheme as quant/trellis/viterbi.py (reference §3.6), organised for a GPU:

* The 65,536 codebook values are loaded once per program into registers as fp16 (128 KB: an fp32 table
  would fill the whole register file), viewed as (U, EH, EL) = (top D bits, middle 16-2D bits, low D bits)
  of the state, so the 2^D candidates of an edge and the 2^D edges sharing a predecessor sit in one thread.
* Edge costs stay on chip across the steps (registers, exchanged through shared memory once per step), in the
  arithmetic chosen by ``COSTS`` (a compile-time switch, :data:`COST_MODES`; :func:`default_costs` per rate):
  - ``mixed`` (the default up to K = 6): fp32 costs plus fp32 squares of the fp16 differences c − fp16(x)
    (half2 subtractions, one conversion and one fma per state). Rounding x to fp16 shifts the target by
    < 2^-11 of itself: the MSE of N(0, 0.81) targets grows by 3.5e-8, 1.8e-4 of D(R) at K = 6.
  - ``fp32`` (the default from K = 7, where that shift is 7e-4 of D(R) and more): ``mixed`` corrected by the
    part of x that fp16 drops (one more add per state); a difference is exact where c is within a factor 2 of
    fp16(x), i.e. for every candidate near the target.
  - ``exact``: the torch path's own arithmetic, fp32 c² − 2xc (x² is common to all states and dropped) with one
    rounding, added to fp32 costs: the same states as the torch path, at ~1.4x the instructions of ``mixed``.
  - ``fp16``: fp16 differences, squares and costs (half2 arithmetic), renormalised every ``RENORM_EVERY``
    steps: an 11-bit cost decides near-ties wrongly.
  All pick the lowest predecessor on ties, like the torch path's ``argmin``. Offline sm_90 builds (8 warps,
  255 registers): at D = 1 (K = 1, 1.5: 32,768 edges) fp32 costs beside the fp16 codebook spill a little; at
  K = 7, 8 one of the two passes spills (the 2^D candidates of an edge and their predecessor costs in one thread).
* Each step writes its argmin choices packed, D bits per edge (1 byte per edge from D = 5 up), to global
  memory; a second kernel traces all tiles back at once, one thread per tile.

Pass 1 starts free at position 128, runs once round the ring and traces back to position 0: that picks the
seam edge (the high 16-D bits of s_0, = the low bits of s_255); the traceback starts from the lowest state of
least cost, as the torch path's ``argmin``. Pass 2 runs 0..255 from that edge and ends on it, so the ring is
self-consistent by construction. Half rates (1.5, 2.5, 3.5: D(p) = ⌊K⌋ + (p odd)) run ``_forward_half_src``:
two steps per iteration, the edge costs of a step indexed by the low 16 − D(p+1) bits of its state, so the even
and odd steps see the codebook as (2^B, M, 2^A) and (2^A, M, 2^B) (A = ⌊K⌋, B = A + 1).
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from functools import lru_cache

import torch
import triton
import triton.language as tl

try:  # Gluon ships with Triton from 3.4 on; an older Triton keeps the Triton forward everywhere
    from . import viterbi_gluon
except ImportError:
    viterbi_gluon = None

NSTATES = 65536
RENORM_EVERY = 16
# Backpointer budget per launch group; a tile needs 256 rows of (65536 >> D) · D / 8 bytes (1 MB at D = 2).
MAX_BP_BYTES = 4 << 30
# One program per SM: the fp16 codebook alone takes half the register file. 8 warps of 255 registers hold
# 256 states per thread (sm_90 SASS, default arithmetic: no or few spills at K = 2..6); 32 warps of 64
# registers spill.
NUM_WARPS = 8

HALF_RATES = (1.5, 2.5, 3.5)
COST_MODES = {"fp16": 0, "mixed": 1, "exact": 2, "fp32": 3}
# Forward kernels: "gluon" (quant/trellis/viterbi_gluon.py: integer K = 2..4, mixed or fp32 costs) and "triton" (this
# module's, every rate and arithmetic). Both write the same backpointer rows for the traceback below.
FORWARDS = ("gluon", "triton")
GLUON_COSTS = ("mixed", "fp32")


def supported(bits: float) -> bool:
    """Whether the fused kernel handles this bitrate (integer K 1..8, or 1.5/2.5/3.5)."""
    return (float(bits) == int(bits) and 1 <= int(bits) <= 8) or float(bits) in HALF_RATES


def default_costs(bits: float) -> str:
    """The cost arithmetic used for this bitrate: ``mixed`` up to K = 6, ``fp32`` above (there fp16(x) would
    move the target by as much as the trellis error: rounding N(0, 0.81) targets to fp16 adds 3.5e-8 to the MSE,
    = 1.8e-4 of D(R) at K = 6, 7e-4 at K = 7, 2.8e-3 at K = 8)."""
    return "mixed" if float(bits) <= 6 else "fp32"


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


@triton.jit
def _branch_costs(old, c, x, COSTS: tl.constexpr):
    """cost[u, m, l] = old[u, m] + the error of codebook value c[u, m, l] (fp16) against the target x (fp32)."""
    xh = x.to(tl.float16)
    if COSTS == 0:  # fp16
        d = c - xh
        cost = old[:, :, None] + d * d
    elif COSTS == 2:
        # exact: the torch path's c² − 2xc (x² is common to all states) with one rounding. The zero depends on
        # the step: it keeps the compiler from hoisting an fp32 codebook (256 more registers per thread) out of
        # the loop (c + 0 is exact)
        cf = (c + (x * 0.0).to(tl.float16)).to(tl.float32)
        cost = old[:, :, None] + tl.fma(cf, -2.0 * x, cf * cf)
    else:
        d = (c - xh).to(tl.float32)  # exact where c is within a factor 2 of fp16(x) (Sterbenz): near the target
        if COSTS == 3:  # fp32: corrected by the part of x that fp16 drops
            d = d - (x - xh.to(tl.float32))
        cost = tl.fma(d, d, old[:, :, None])
    return cost


@triton.jit
def _keep_lower(a, ia, b, ib):
    take = b < a  # strict: a tie keeps the lower index (the reduction combines in index order)
    return tl.where(take, b, a), tl.where(take, ib, ia)


@triton.jit
def _select(cost, iu, U: tl.constexpr):
    """(min over axis 0, its lowest index): the torch path's argmin order. fp32: one compare and two selects
    per candidate; fp16: min, then compare and select (packed half2 compares are cheaper than the pairs)."""
    if cost.dtype == tl.float32:
        return tl.reduce((cost, tl.broadcast_to(iu, cost.shape)), 0, _keep_lower)
    new = tl.min(cost, axis=0).to(cost.dtype)  # (tl.min widens fp16)
    return new, tl.min(tl.where(cost == new[None, :, :], iu, U), axis=0)


@triton.jit
def _lowest_best_state(cost, flat):
    """The lowest state index among the cheapest (``flat``: the state index of each cost entry)."""
    best = tl.min(tl.reshape(cost, (65536,)), axis=0)
    return tl.min(tl.reshape(tl.where(cost == best, flat, 65536), (65536,)), axis=0)


@triton.jit
def _store_bp(bp_ptr, t, p, arg, keep, D: tl.constexpr):
    """Write one step's argmins (EH, EL) packed, D bits per edge (D ≤ 4), else one byte per edge."""
    U: tl.constexpr = 1 << D
    EH: tl.constexpr = 1 << (16 - 2 * D)
    if D <= 4:
        shifts = (tl.arange(0, U) * D)[None, :]
        row = tl.arange(0, EH)
        if D <= 2:
            packed = tl.sum(arg << shifts, axis=1).to(tl.uint8)
        elif D == 3:
            packed = tl.sum(arg << shifts, axis=1)
        else:
            packed = tl.sum(arg.to(tl.int64) << shifts.to(tl.int64), axis=1)
        tl.store(bp_ptr + (t * 256 + p) * EH + row, packed, mask=keep)
    else:
        row = tl.arange(0, EH * U).reshape(EH, U)
        tl.store(bp_ptr + (t * 256 + p) * (EH * U) + row, arg.to(tl.uint8), mask=keep)


def _forward_src(x_ptr, table_ptr, bp_ptr, seam_ptr, final_ptr, D: tl.constexpr, FREE: tl.constexpr,
                 COSTS: tl.constexpr, RENORM: tl.constexpr, GATHER: tl.constexpr):
    """One pass of one tile. FREE: pass 1 (positions 128..255, 0..127, free start, backpointers kept for
    positions < 128, writes the edge of the cheapest final state); else pass 2 (0..255, starts on the tile's
    seam edge). GATHER: move the edge costs to their next-step layout with an identity gather instead of a
    reshape (Triton lowers it differently: at D = 2, 22 barriers per step instead of 34)."""
    U: tl.constexpr = 1 << D
    EH: tl.constexpr = 1 << (16 - 2 * D)
    NE: tl.constexpr = 1 << (16 - D)
    t = tl.program_id(0).to(tl.int64)
    # c[u, eh, el] = codebook(state (u << 16-D) | (eh << D) | el): the flat table read in state order
    c = tl.load(table_ptr + tl.arange(0, 65536)).reshape(U, EH, U)
    iu = tl.arange(0, U)[:, None, None]
    rows = tl.broadcast_to(tl.arange(0, U)[:, None], (U, EH))
    if FREE:
        old = tl.zeros((U, EH), tl.float32)
        offset = 128
    else:
        j = tl.arange(0, NE).reshape(U, EH)  # predecessor edge index (u << 16-2D) | eh
        old = tl.where(j == tl.load(seam_ptr + t), 0.0, float("inf"))
        offset = 0
    if COSTS == 0:
        old = old.to(tl.float16)
    for i in range(255):
        p = (i + offset) & 255
        cost = _branch_costs(old, c, tl.load(x_ptr + t * 256 + p), COSTS)
        new, arg = _select(cost, iu, U)
        _store_bp(bp_ptr, t, p, arg, (p < 128) | (not FREE), D)
        old = tl.reshape(new, (U, EH))  # next step's predecessor index = this edge
        if GATHER:
            old = tl.gather(old, rows, 0)
        if COSTS == 0:
            if (i % RENORM) == RENORM - 1:
                old = old - tl.min(tl.min(old, axis=1), axis=0).to(tl.float16)
    p = (255 + offset) & 255  # the last step, outside the loop: pass 1 picks its final state from its costs
    cost = _branch_costs(old, c, tl.load(x_ptr + t * 256 + p), COSTS)
    new, arg = _select(cost, iu, U)
    _store_bp(bp_ptr, t, p, arg, True, D)
    if FREE:
        s = _lowest_best_state(cost, tl.arange(0, 65536).reshape(U, EH, U))
        tl.store(final_ptr + t, (s & (NE - 1)).to(tl.int32))


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
def _step_half(old, c, iu, x, RED: tl.constexpr, EL: tl.constexpr, COSTS: tl.constexpr, PT: tl.constexpr):
    """One step of a half rate: old (2^RED, M) predecessor costs, c (2^RED, M, 2^EL) codebook view; returns the
    cost (2^RED, M, 2^EL), the new costs (M · 2^EL,) and the argmins packed RED bits per edge, one PT word per
    M row."""
    cost = _branch_costs(old, c, x, COSTS)
    new, arg = _select(cost, iu, 1 << RED)
    shifts = (tl.arange(0, 1 << EL) * RED)[None, :].to(PT)
    packed = tl.sum(arg.to(PT) << shifts, axis=1)
    return cost, tl.reshape(new, ((1 << (16 - EL - RED)) << EL,)), packed


def _forward_half_src(x_ptr, table_ptr, bp_ptr, seam_ptr, final_ptr, A: tl.constexpr, FREE: tl.constexpr,
                      COSTS: tl.constexpr, RENORM: tl.constexpr, PT: tl.constexpr):
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
        old = tl.zeros((1 << B, M), tl.float32)
        offset = 128
    else:
        j = tl.arange(0, 1 << (16 - A)).reshape(1 << B, M)
        old = tl.where(j == tl.load(seam_ptr + t), 0.0, float("inf"))
        offset = 0
    if COSTS == 0:
        old = old.to(tl.float16)
    for i in range(0, 254, 2):
        p = (i + offset) & 255
        keep = (p < 128) | (not FREE)
        _, new, packed = _step_half(old, c_even, iu_even, tl.load(x_ptr + t * 256 + p), B, A, COSTS, PT)
        tl.store(bp_ptr + (t * 256 + p) * M + row, packed, mask=keep)
        _, new, packed = _step_half(tl.reshape(new, (1 << A, M)), c_odd, iu_odd, tl.load(x_ptr + t * 256 + p + 1),
                                    A, B, COSTS, PT)
        tl.store(bp_ptr + (t * 256 + p + 1) * M + row, packed, mask=keep)
        old = tl.reshape(new, (1 << B, M))
        if COSTS == 0:
            if (i % RENORM) == RENORM - 2:
                old = old - tl.min(tl.min(old, axis=1), axis=0).to(tl.float16)
    p = (254 + offset) & 255  # the last pair, outside the loop: pass 1 picks its final state from its costs
    _, new, packed = _step_half(old, c_even, iu_even, tl.load(x_ptr + t * 256 + p), B, A, COSTS, PT)
    tl.store(bp_ptr + (t * 256 + p) * M + row, packed)
    cost, new, packed = _step_half(tl.reshape(new, (1 << A, M)), c_odd, iu_odd, tl.load(x_ptr + t * 256 + p + 1),
                                   A, B, COSTS, PT)
    tl.store(bp_ptr + (t * 256 + p + 1) * M + row, packed)
    if FREE:
        s = _lowest_best_state(cost, tl.arange(0, 65536).reshape(1 << A, M, 1 << B))
        tl.store(final_ptr + t, (s & ((1 << (16 - A)) - 1)).to(tl.int32))


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


def gluon_serves(bits: float, costs: str | None = None) -> bool:
    """Whether the Gluon forward handles this bitrate and cost arithmetic (None: :func:`default_costs`)."""
    name = default_costs(bits) if costs is None else costs
    return viterbi_gluon is not None and viterbi_gluon.supported(bits) and name in GLUON_COSTS


def default_forward(bits: float, costs: str | None = None) -> str:
    """The forward kernel used for a bitrate and cost arithmetic: Triton's. The Gluon forward runs where it is
    asked for by name (``forward="gluon"``): in a 288-expert MoE layer its K = 3 encode was slower in the Viterbi
    than the Triton forward's (docs/journal/13-real-widths-at-288-experts-fourth-pass-the-cpu-pass-timed-on.md)."""
    return "triton"


def _cost_mode(bits: float, costs: str | None) -> int:
    name = default_costs(bits) if costs is None else costs
    if name not in COST_MODES:
        raise ValueError(f"unknown cost arithmetic {name!r}; expected one of {sorted(COST_MODES)}")
    return COST_MODES[name]


def _launch_plan(bits: float, costs: str | None, exchange: str = "reshape", forward: str | None = None):
    """(forward, traceback, backpointer dtype, elements per backpointer row, forward and traceback constexprs)."""
    mode = _cost_mode(bits, costs)
    if exchange not in ("reshape", "gather"):
        raise ValueError(f"unknown cost exchange {exchange!r}; expected 'reshape' or 'gather'")
    forward = default_forward(bits, costs) if forward is None else forward
    if forward not in FORWARDS:
        raise ValueError(f"unknown forward kernel {forward!r}; expected one of {FORWARDS}")
    if forward == "gluon" and not gluon_serves(bits, costs):
        raise ValueError(f"the Gluon forward serves integer K = 2..4 with {GLUON_COSTS} costs (Triton with Gluon), "
                         f"not K={bits} with {costs} costs")
    if float(bits) in HALF_RATES:
        a = int(bits)  # A = ⌊K⌋
        fwd, back = half_kernels()
        return (fwd, back, torch.int64 if a == 3 else torch.int32, 1 << (15 - 2 * a),
                dict(A=a, COSTS=mode, RENORM=RENORM_EVERY, PT=tl.int64 if a == 3 else tl.int32), dict(A=a))
    d = int(bits)
    fwd, back = kernels()
    dtype, row = bp_layout(d)
    if forward == "gluon":
        return viterbi_gluon.forward, back, dtype, row, dict(D=d, COSTS=mode), dict(D=d)
    return fwd, back, dtype, row, dict(D=d, COSTS=mode, RENORM=RENORM_EVERY, GATHER=exchange == "gather"), dict(D=d)


def encode(x: torch.Tensor, table16: torch.Tensor, bits: float, max_bp_bytes: int = MAX_BP_BYTES,
           costs: str | None = None, exchange: str = "reshape", forward: str | None = None) -> torch.Tensor:
    """Tail-biting Viterbi of (T, 256) targets (tensor-core order) against an fp16 codebook table (65536,).

    Args:
        x: (T, 256) targets, any float dtype (read as fp32).
        table16: (65536,) fp16 codebook values in state order.
        bits: K (integer 1..8 or a half rate).
        max_bp_bytes: backpointer memory per launch group.
        costs: cost arithmetic, a key of :data:`COST_MODES`; None: :func:`default_costs`.
        exchange: "reshape" or "gather" (the Triton forward at integer K): how the edge costs reach their
            next-step layout.
        forward: a key of :data:`FORWARDS`; None: :func:`default_forward`.
    Returns:
        (T, 256) int64 states forming consistent rings.
    """
    fwd, back, dtype, row, fwd_args, back_args = _launch_plan(bits, costs, exchange, forward)
    x = x.float().contiguous()
    t_all = x.shape[0]
    out = torch.empty(t_all, 256, dtype=torch.int32, device=x.device)
    if t_all == 0:
        return out.long()
    per_tile = 256 * row * torch.empty((), dtype=dtype).element_size()
    chunk = max(1, min(t_all, max_bp_bytes // per_tile))
    bp = torch.empty(chunk, 256, row, dtype=dtype, device=x.device)
    final = torch.empty(chunk, dtype=torch.int32, device=x.device)
    seam = torch.empty(chunk, dtype=torch.int32, device=x.device)
    block = 128
    for lo in range(0, t_all, chunk):
        xs = x[lo:lo + chunk]
        n = xs.shape[0]
        os_ = out[lo:lo + n]
        grid_t = (-(-n // block),)
        fwd[(n,)](xs, table16, bp, seam, final, FREE=True, num_warps=NUM_WARPS, **fwd_args)
        back[grid_t](bp, final, os_, seam, n, LAST=127, WRITE=False, BLOCK=block, num_warps=4, **back_args)
        fwd[(n,)](xs, table16, bp, seam, final, FREE=False, num_warps=NUM_WARPS, **fwd_args)
        back[grid_t](bp, seam, os_, seam, n, LAST=255, WRITE=True, BLOCK=block, num_warps=4, **back_args)
    return out.long()


def forward_resources(bits: float, costs: str | None = None, device: str = "cuda",
                      exchange: str = "reshape", forward: str | None = None) -> dict[str, dict[str, int]]:
    """Registers per thread, spilled registers and shared memory bytes of the compiled forward kernels
    ({"pass1": ..., "pass2": ...}) for a bitrate and cost arithmetic (compiles them if needed; for benchmarks)."""
    fwd, _, dtype, row, fwd_args, _ = _launch_plan(bits, costs, exchange, forward)
    x = torch.zeros(1, 256, device=device)
    table16 = torch.zeros(NSTATES, dtype=torch.float16, device=device)
    bp = torch.empty(1, 256, row, dtype=dtype, device=device)
    edge = torch.zeros(1, dtype=torch.int32, device=device)
    out = {}
    for name, free in (("pass1", True), ("pass2", False)):
        kern = fwd.warmup(x, table16, bp, edge, edge, FREE=free, num_warps=NUM_WARPS, grid=(1,), **fwd_args)
        kern = kern.result() if hasattr(kern, "result") else kern  # (an asynchronous compile)
        kern._init_handles()
        out[name] = {"n_regs": int(kern.n_regs), "n_spills": int(kern.n_spills), "shared": int(kern.metadata.shared)}
    return out


def forward_step_ops(bits: int, free: bool, costs: str | None = None, forward: str | None = None,
                     arch: int = 90) -> collections.Counter:
    """Opcode counts (SASS, without modifiers) of one step of a forward kernel at integer K, compiled offline for
    compute capability ``arch`` with the tools Triton ships (no device needed): the longest loop of the kernel, its
    255 steps. For benchmarks and tests of the kernels' instruction budgets."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fwd, _, dtype, _, fwd_args, _ = _launch_plan(bits, costs, "reshape", forward)
    ptr = {torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64"}[dtype]
    sig = {"x_ptr": "*fp32", "table_ptr": "*fp16", "bp_ptr": ptr, "seam_ptr": "*i32", "final_ptr": "*i32"}
    consts = dict(fwd_args, FREE=free)
    source = ASTSource
    if fwd is getattr(viterbi_gluon, "forward", None):
        from triton.experimental.gluon._runtime import GluonASTSource as source
    sig.update({k: "constexpr" for k in consts})
    names = list(fwd.arg_names)  # the kernel's parameter order
    sig = {k: sig[k] for k in names}
    src = source(fn=fwd, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    kern = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": NUM_WARPS})
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "forward.cubin")
        with open(path, "wb") as f:
            f.write(kern.asm["cubin"])
        text = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", path], capture_output=True, text=True,
                              check=True).stdout
    labels, body = {}, []
    for line in text.splitlines():
        if m := re.match(r"^\.L_x_(\d+):", line.strip()):
            labels[m.group(1)] = len(body)
        elif m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line):
            body.append(m.group(1))
    loops = [body[labels[m.group(1)]:i + 1] for i, ins in enumerate(body)
             if (m := re.search(r"BRA.*\.L_x_(\d+)", ins)) and labels.get(m.group(1), len(body)) < i]
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]
                               for ins in max(loops, key=len))
