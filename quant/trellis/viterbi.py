"""Tail-biting Viterbi over the 65,536-state bitshift trellis, vectorised over tiles (reference §3.6).

State s_p = ((s_{p-1} << D(p)) | v_p) & 0xFFFF, so the predecessors of s are the 2^D states whose low 16-D bits
equal s >> D. Costs are kept in float32 (the reference kernel uses fp16, which costs it accuracy).

Tail-biting is solved in two passes like the reference: a free-start run over a window around the ring seam
(``warm`` positions before and after it; the whole ring on a GPU, a shorter window on the CPU) picks the seam
edge, then pass 2 runs the full ring constrained to start and end on that edge, which makes the ring
self-consistent by construction. On CUDA every bitrate runs the fused kernel of quant/trellis/viterbi_triton.py (one
program per tile for all 256 steps); if it is unavailable, a per-step Triton add-compare-select with uint8
backpointers. Elsewhere plain torch ops, with backpointers recomputed from stored minima.
"""
from __future__ import annotations

import os
import warnings

import torch

from .codebooks import codebook_table, step_bits

NSTATES = 65536
_INF = float("inf")
WARM: int | None = None  # overrides default_warm (bench/speed/trellis.py compares seam windows)


def default_warm(bits: float) -> int:
    """Seam window (positions each side) for pass 1: ~5 state lengths, enough for survivor paths to merge."""
    return min(128, 24 + int(64 // int(bits)))


def _min_over_top_bits(cost: torch.Tensor, dp: int) -> torch.Tensor:
    """min over the top dp bits of the state: (T, 65536) → (T, 65536 >> dp), as a halving tree (fast on CPU)."""
    a = cost
    for _ in range(dp):
        h = a.shape[1] >> 1
        a = torch.minimum(a[:, :h], a[:, h:])
    return a


def _dist(table2: torch.Tensor, table: torch.Tensor, xp: torch.Tensor) -> torch.Tensor:
    """(c − x)² − x² = c² − 2xc for every state (the x² term is common to all states, so it is dropped)."""
    return torch.addcmul(table2, xp, table, value=-2.0)


def _acs_torch(mprev: torch.Tensor | None, table: torch.Tensor, table2: torch.Tensor, xprev: torch.Tensor,
               dprev: int, dp: int) -> torch.Tensor:
    """One add-compare-select step: m_new[e] = min_u cost_prev[(u << (16-dp)) | e] with
    cost_prev[s] = m_prev[s >> dprev] + dist_prev(s)."""
    t = xprev.shape[0]
    cost = _dist(table2, table, xprev)
    if mprev is not None:
        cost = cost.view(t, NSTATES >> dprev, 1 << dprev).add_(mprev.unsqueeze(-1)).view(t, NSTATES)
    return _min_over_top_bits(cost, dp)


def _forward(x: torch.Tensor, table: torch.Tensor, table2: torch.Tensor, d: tuple[int, ...], positions: list[int],
             m0: torch.Tensor | None, keep_from: int) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Add-compare-select over ``positions``; returns the final cost (T, 65536) and, from step keep_from on,
    each step's edge minima m (T, 65536 >> D): the cost of state s at step i is m_i[s >> D_i] + dist_i(s).
    Backpointers are recomputed from the stored minima during the traceback (cheaper than an argmin per step).

    m0: edge minima of the first step (from the tail-biting constraint), or None for a free start.
    """
    acs = _acs_triton if (x.is_cuda and _triton_ok("acs")) else _acs_torch
    ms: list[torch.Tensor | None] = []
    m = m0
    for i, p in enumerate(positions):
        if i > 0:
            pp = positions[i - 1]
            m = acs(m, table, table2, x[:, pp:pp + 1], d[pp], d[p])
        if i >= keep_from:
            ms.append(m)
    t = x.shape[0]
    pl = positions[-1]
    cost = _dist(table2, table, x[:, pl:pl + 1])
    if m is not None:
        cost = cost.view(t, NSTATES >> d[pl], 1 << d[pl]).add_(m.unsqueeze(-1)).view(t, NSTATES)
    return cost, ms


def _traceback(last: torch.Tensor, ms: list[torch.Tensor | None], x: torch.Tensor, table: torch.Tensor,
               table2: torch.Tensor, d: tuple[int, ...], positions: list[int]) -> list[torch.Tensor]:
    """States at the last len(ms) positions, given the final state ``last`` (T,) int64.

    The predecessor of s at step j is the u minimising cost_{j-1}[(u << (16-D)) | (s >> D)], recomputed from the
    stored minima of step j-1: cost_{j-1}[q] = m_{j-1}[q >> D_{j-1}] + dist_{j-1}(q).
    """
    out = [last]
    s = last
    n = len(ms)
    off = len(positions) - n
    rows = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
    for j in range(n - 1, 0, -1):
        p, pp = positions[off + j], positions[off + j - 1]
        dp, dpp = d[p], d[pp]
        e = s >> dp
        cand = (torch.arange(1 << dp, device=x.device).unsqueeze(0) << (16 - dp)) | e.unsqueeze(1)  # (T, 2^D)
        c = torch.addcmul(table2[cand], x[:, pp:pp + 1], table[cand], value=-2.0)
        mprev = ms[j - 1]
        if mprev is not None:
            c = c + mprev[rows, cand >> dpp]
        u = c.argmin(dim=1)
        s = (u << (16 - dp)) | e
        out.append(s)
    out.reverse()
    return out


def _pass_torch(x, table, table2, d, positions, m0, n_keep, select_last):
    """One Viterbi pass with torch ops; returns the states of the last n_keep positions (T, n_keep)."""
    cost, ms = _forward(x, table, table2, d, positions, m0, keep_from=len(positions) - n_keep)
    return torch.stack(_traceback(select_last(cost), ms, x, table, table2, d, positions), dim=1)


def viterbi_tiles(x: torch.Tensor, table: torch.Tensor, bits: float, warm: int | None = None) -> torch.Tensor:
    """Encode (T, 256) targets (tensor-core order) as consistent tail-biting rings; return (T, 256) int64 states."""
    if x.is_cuda and warm in (None, 128) and WARM in (None, 128) and fused_ok(bits):
        from . import viterbi_triton as viterbi_fused  # local: viterbi_triton imports triton (optional)
        return viterbi_fused.encode(x, table.half(), float(bits), forward=_FUSED[float(bits)])
    d = step_bits(float(bits))
    if warm is None:  # the full-ring pass 1 is ~1% better; worth its cost on a GPU, not in CPU tests
        warm = WARM or (128 if x.is_cuda else default_warm(bits))
    t = x.shape[0]
    x = x.float().contiguous()
    table2 = table * table
    run = _pass_triton if (x.is_cuda and _triton_ok("pass")) else _pass_torch
    # pass 1: free start `warm` positions before the seam, through the seam, `warm` positions past it
    seam = list(range(256 - warm, 256)) + list(range(warm))
    s255 = run(x, table, table2, d, seam, None, warm + 1, lambda c: c.argmin(dim=1))[:, 0]
    d0 = d[0]
    edge = s255 & ((NSTATES >> d0) - 1)  # low 16-D(0) bits of s_255 = high bits of s_0
    # pass 2: whole ring from position 0, previous state restricted to the seam edge
    m0 = torch.full((t, NSTATES >> d0), _INF, device=x.device)
    m0.scatter_(1, edge.view(t, 1), 0.0)

    def end_on_edge(cost):  # final state must end on the seam edge: s_255 = (u << (16-D0)) | edge
        ends = cost.view(t, 1 << d0, NSTATES >> d0).gather(2, edge.view(t, 1, 1).expand(t, 1 << d0, 1)).squeeze(2)
        return (ends.argmin(dim=1) << (16 - d0)) | edge

    return run(x, table, table2, d, list(range(256)), m0, 256, end_on_edge)


# ---------------------------------------------------------------------------------------------------------------
# Fused add-compare-select on CUDA (Triton): reads the previous minima and the codebook from L2 and writes only the
# new minima, ~8× less memory traffic than the torch ops above. Checked against the torch step on first use.

_TRITON: dict = {}


def _triton_ok(what: str = "acs") -> bool:
    """Whether the Triton kernels compiled and agree with the torch path ('acs' step; 'pass' = whole pass)."""
    if "acs" not in _TRITON:
        _TRITON["acs"] = _TRITON["pass"] = False
        if os.environ.get("MIXQ_TRELLIS_TRITON", "1") != "0":
            try:
                _build_triton()
                _TRITON["acs"] = _self_check_acs()
                _TRITON["pass"] = _TRITON["acs"] and _self_check_pass()
            except Exception as exc:  # no triton / no GPU compiler: the torch path is always correct
                warnings.warn(f"trellis: Triton Viterbi unavailable ({exc!r}); using torch ops")
    return _TRITON[what]


def _build_triton() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def acs_kernel(mprev_ptr, mout_ptr, bp_ptr, x_ptr, table_ptr, table2_ptr, xstride, col, bp_stride,
                   DPREV: tl.constexpr, D: tl.constexpr, FREE: tl.constexpr, WRITE_BP: tl.constexpr,
                   BLOCK: tl.constexpr):
        t = tl.program_id(0)
        e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        xp = tl.load(x_ptr + t * xstride + col)
        best = tl.full((BLOCK,), float("inf"), tl.float32)
        arg = tl.zeros((BLOCK,), tl.int32)
        for u in range(1 << D):
            s = (u << (16 - D)) | e
            c = tl.fma(tl.load(table_ptr + s), -2.0 * xp, tl.load(table2_ptr + s))  # one rounding, as addcmul
            if not FREE:
                c += tl.load(mprev_ptr + t * (65536 >> DPREV) + (s >> DPREV))
            better = c < best
            best = tl.where(better, c, best)
            arg = tl.where(better, u, arg)
        tl.store(mout_ptr + t * (65536 >> D) + e, best)
        if WRITE_BP:
            tl.store(bp_ptr + t.to(tl.int64) * bp_stride + e, arg.to(tl.uint8))

    @triton.jit
    def traceback_kernel(bp_ptr, last_ptr, out_ptr, dseq_ptr, T, n, bp_step, bp_stride, BLOCK: tl.constexpr):
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = t < T
        s = tl.load(last_ptr + t, mask=mask, other=0)
        for j in range(n):
            i = n - 1 - j
            tl.store(out_ptr + t * n + i, s, mask=mask)
            dcur = tl.load(dseq_ptr + i)
            e = s >> dcur
            u = tl.load(bp_ptr + i.to(tl.int64) * bp_step + t.to(tl.int64) * bp_stride + e,
                        mask=mask & (i > 0), other=0).to(tl.int32)
            s = tl.where(i > 0, (u << (16 - dcur)) | e, s)

    _TRITON["kernel"] = acs_kernel
    _TRITON["traceback"] = traceback_kernel


def _acs_triton(mprev, table, table2, xprev, dprev, dp, bp=None):
    t = xprev.shape[0]
    out = torch.empty(t, NSTATES >> dp, device=xprev.device)
    block = min(1024, NSTATES >> dp)
    xcol = xprev if xprev.is_contiguous() else xprev.contiguous()
    grid = (t, (NSTATES >> dp) // block)
    _TRITON["kernel"][grid](mprev if mprev is not None else out, out, bp if bp is not None else out, xcol, table,
                            table2, xcol.stride(0), 0, bp.stride(0) if bp is not None else 0,
                            DPREV=dprev, D=dp, FREE=mprev is None, WRITE_BP=bp is not None, BLOCK=block,
                            num_warps=4)
    return out


def _pass_triton(x, table, table2, d, positions, m0, n_keep, select_last):
    """Viterbi pass with the fused ACS kernel writing uint8 backpointers and a one-launch traceback kernel."""
    t, n = x.shape[0], len(positions)
    emax = NSTATES >> min(d[p] for p in positions)
    bp = torch.empty(n, t, emax, dtype=torch.uint8, device=x.device)
    m = m0
    for i in range(1, n):
        pp, p = positions[i - 1], positions[i]
        m = _acs_triton(m, table, table2, x[:, pp:pp + 1], d[pp], d[p], bp[i])
    pl = positions[-1]
    cost = _dist(table2, table, x[:, pl:pl + 1])
    if m is not None:
        cost = cost.view(t, NSTATES >> d[pl], 1 << d[pl]).add_(m.unsqueeze(-1)).view(t, NSTATES)
    last = select_last(cost).to(torch.int32).contiguous()
    dseq = torch.tensor([d[p] for p in positions], dtype=torch.int32, device=x.device)
    out = torch.empty(t, n, dtype=torch.int32, device=x.device)
    block = 128
    _TRITON["traceback"][(triton_cdiv(t, block),)](bp, last, out, dseq, t, n, bp.stride(0), bp.stride(1),
                                                   BLOCK=block, num_warps=4)
    return out[:, n - n_keep:].long()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _self_check_acs() -> bool:
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    table = torch.randn(NSTATES, generator=g).to(dev)
    table2 = table * table
    ok = True
    for dprev, dp in ((2, 2), (1, 2), (2, 1), (8, 8)):
        x = torch.randn(3, 1, generator=g).to(dev)
        mprev = torch.randn(3, NSTATES >> dprev, generator=g).to(dev)
        for mp in (None, mprev):
            a = _acs_triton(mp, table, table2, x, dprev, dp)
            b = _acs_torch(mp, table, table2, x, dprev, dp)
            ok &= bool(torch.allclose(a, b, rtol=1e-5, atol=1e-4))
    if not ok:
        warnings.warn("trellis: Triton Viterbi step disagrees with torch; using torch ops")
    return ok


def _self_check_pass() -> bool:
    """Whole tail-biting encodes with both paths must reach the same squared error (ties aside)."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    table = torch.randn(NSTATES, generator=g).to(dev)
    x = torch.randn(6, 256, generator=g).to(dev)
    ok = True
    for bits in (2, 2.5, 8):
        d = step_bits(float(bits))
        pos = list(range(200, 256)) + list(range(40))
        sel = lambda c: c.argmin(dim=1)  # noqa: E731
        a = _pass_triton(x, table, table * table, d, pos, None, len(pos), sel)
        b = _pass_torch(x, table, table * table, d, pos, None, len(pos), sel)
        xa = x[:, pos]
        ea = (table[a] - xa).square().sum(1)
        eb = (table[b] - xa).square().sum(1)
        ok &= bool(torch.allclose(ea, eb, rtol=1e-4, atol=1e-4))
        ok &= bool(((a[:, 1:] >> torch.tensor([d[p] for p in pos[1:]], device=dev)) ==
                    (a[:, :-1] & ((NSTATES >> torch.tensor([d[p] for p in pos[1:]], device=dev)) - 1))).all())
    if not ok:
        warnings.warn("trellis: Triton Viterbi pass disagrees with torch; using the torch traceback")
    return ok


def viterbi_free(x: torch.Tensor, table: torch.Tensor, bits: float) -> torch.Tensor:
    """Free-start, free-end Viterbi MSE per tile (T,) — the cheap proxy used by the scale search. On CUDA with
    the fused kernel: the MSE of the tail-biting encode itself (as cheap there, and what the tiles will get)."""
    if x.is_cuda and fused_ok(bits):
        from . import viterbi_triton as viterbi_fused  # local: viterbi_triton imports triton (optional)
        states = viterbi_fused.encode(x, table.half(), float(bits), forward=_FUSED[float(bits)])
        return (table[states] - x.float()).square().mean(1)
    d = step_bits(float(bits))
    x = x.float().contiguous()
    cost, _ = _forward(x, table, table * table, d, list(range(256)), None, keep_from=1 << 30)
    return (cost.min(dim=1).values + x.square().sum(1)) / 256.0


def encode_tiles(x: torch.Tensor, table: torch.Tensor, bits: float, max_bp_bytes: int | None = None,
                 warm: int | None = None) -> torch.Tensor:
    """Encode any number of tiles in chunks that bound the backpointer memory; returns (T, 256) int64 states."""
    if max_bp_bytes is None:
        max_bp_bytes = (40 << 30) if x.is_cuda else (192 << 20)
    if x.is_cuda and warm in (None, 128) and WARM in (None, 128) and fused_ok(bits):
        return viterbi_tiles(x, table, bits)  # the fused kernel bounds its own backpointer memory
    dmin = min(step_bits(float(bits)))
    per_bp = 1 if (x.is_cuda and _triton_ok("pass")) else 4  # uint8 backpointers vs float32 minima
    per_tile = 256 * per_bp * (NSTATES >> dmin) + 4 * 4 * NSTATES
    chunk = max(1, max_bp_bytes // per_tile)
    outs = [viterbi_tiles(x[i:i + chunk], table, bits, warm) for i in range(0, x.shape[0], chunk)]
    return torch.cat(outs, 0) if outs else torch.zeros(0, 256, dtype=torch.int64, device=x.device)


# ---------------------------------------------------------------------------------------------------------------
# Fused kernel gate: compiled and checked against the torch path once per process and bitrate.

_FUSED: dict[float, str | None] = {}  # per bitrate: the forward kernel that passed its check, or None
_RATES = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0)


def fused_ok(bits: float) -> bool:
    """Whether the fused CUDA kernel serves this bitrate: Triton present, and on first use its encode of a
    few random tiles matches the torch path's squared error (MIXQ_TRELLIS_FUSED=0 turns it off). The Triton
    forward is tried first; failing its check, the Gluon forward where it applies."""
    k = float(bits)
    if k not in _RATES or not torch.cuda.is_available():
        return False
    if k not in _FUSED:
        _FUSED[k] = None
        if os.environ.get("MIXQ_TRELLIS_FUSED", "1") != "0":
            try:
                _FUSED[k] = _checked_forward(k)
            except Exception as exc:  # no triton / compiler failure: the per-step path is always correct
                warnings.warn(f"trellis: fused Viterbi unavailable for K={k} ({exc!r}); using the per-step path")
    return _FUSED[k] is not None


def fused_forward(bits: float) -> str | None:
    """The forward kernel ("gluon" or "triton") the fused path runs at this bitrate, None where it does not run."""
    return _FUSED.get(float(bits)) if fused_ok(bits) else None


def _checked_forward(k: float) -> str | None:
    """The first forward kernel, in preference order, whose encode passes the self-check."""
    from . import viterbi_triton as viterbi_fused  # local: viterbi_triton imports triton (optional)

    tried = [viterbi_fused.default_forward(k)]
    if viterbi_fused.gluon_serves(k) and "gluon" not in tried:
        tried.append("gluon")
    for forward in tried:
        try:
            if _self_check_fused(k, forward=forward):
                return forward
        except Exception as exc:  # a compile failure of one forward leaves the next one
            if forward == tried[-1]:
                raise
            warnings.warn(f"trellis: {forward} Viterbi forward unavailable for K={k} ({exc!r}); trying {tried[-1]}")
    return None


def ring_consistent(states: torch.Tensor, bits: float) -> bool:
    """Whether (T, 256) states form tail-biting rings: s_{p+1} >> D(p+1) = the low 16 − D(p+1) bits of s_p."""
    d = torch.tensor(step_bits(float(bits)), device=states.device)
    dn = torch.roll(d, -1)
    nxt = torch.roll(states, -1, dims=1)
    return bool(((nxt >> dn) == (states & ((1 << (16 - dn)) - 1))).all())


# Self-check tolerance on the mean squared error of 32 tiles. It catches a broken build (garbage is many times
# worse), not rounding: where rounding makes pass 1 pick another seam edge, a ring can be ~1% better or worse.
_CHECK_RTOL = {"exact": 1e-2, "fp32": 1e-2, "mixed": 1e-2, "fp16": 3e-2}


def _self_check_fused(k: float, tiles: int = 32, forward: str | None = None) -> bool:
    from . import viterbi_triton as viterbi_fused  # local: viterbi_triton imports triton (optional)

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(2)
    table = codebook_table("mul1", dev)
    x = (torch.randn(tiles, 256, generator=g) * 0.9).to(dev)
    costs = viterbi_fused.default_costs(k)
    a = viterbi_fused.encode(x, table.half(), k, costs=costs, forward=forward)
    b = viterbi_tiles_reference(x, table, float(k))
    ea = (table[a] - x).square().mean()
    eb = (table[b] - x).square().mean()
    ring = ring_consistent(a, k)
    ok = ring and float(ea) <= float(eb) * (1 + _CHECK_RTOL[costs]) + 1e-7
    if not ok:
        warnings.warn(f"trellis: fused Viterbi ({forward} forward) check failed for K={k} ({costs} costs, "
                      f"ring={ring}, mse {float(ea):.7g} vs {float(eb):.7g}); not used")
    return ok


def viterbi_tiles_reference(x: torch.Tensor, table: torch.Tensor, bits: float) -> torch.Tensor:
    """The per-step path with the full-ring seam pass (what the fused kernel computes), for checks."""
    saved = _FUSED.copy()
    _FUSED.update({k: None for k in _RATES})
    try:
        return viterbi_tiles(x, table, bits, warm=128)
    finally:
        _FUSED.clear()
        _FUSED.update(saved)
