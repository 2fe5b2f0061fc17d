"""The tail-biting Viterbi forward pass of quant/trellis/viterbi_triton.py written in Gluon (Triton's explicit-layout
dialect), for the integer rates K = 1..4.

Same trellis, passes, backpointer rows and traceback as the Triton kernel; what Gluon lets this one fix:

* Layout. Each thread owns, for its edges' middle bits m (m = lane + 32·warp + 256·i), every one of the 2^D
  predecessors u and every one of the 2^D new low bits l: the codebook view c[u, m, l] (fp16), the branch costs
  and the minimum over u all stay in the thread's registers, and one step's backpointers of an m pack in place.
* Exchange. The new edge costs go to shared memory as written (EH x 2^D, row-major) and come back as the next
  step's (2^D x EH) predecessor view: one store, one load and two barriers a step. Triton's own layout conversion
  of that reshape makes eight rounds of store and load with two barriers each (sm_90 SASS: 65 shared loads and
  16 barriers a step at K = 3 against 8 and 2 here).
* Selection. The minimum over u and its argmin in one integer min: a cost's float bits with the low D bits
  replaced by u order like (truncated cost, u), so the lowest u wins a tie as in the torch path's argmin, and the
  truncation moves a cost by at most 2^D ulp (2^-19 of itself at D = 4).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# 2^(16-2D) middle bits per u must cover the 256 threads of a program (D ≤ 4); at D = 1 the 64 middle bits a
# thread owns hold 128 predecessor costs beside the codebook, and the step loop spills (sm_90 SASS)
MIN_D, MAX_D = 2, 4
# a barrier of the program's threads: gl.barrier from Triton 3.7 on (the Triton torch 2.13 pins), gl.thread_barrier
# before
thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


def supported(bits: float) -> bool:
    """Whether this forward serves the bitrate: integer K with MIN_D ≤ K ≤ MAX_D."""
    return float(bits) == int(bits) and MIN_D <= int(bits) <= MAX_D


@gluon.jit
def _costs(c, x, old, COSTS: gl.constexpr):
    """cost[u, m, l] = old[u, m] + (c[u, m, l] − x)² in the arithmetic of viterbi_triton's COSTS 1 (``mixed``) or
    3 (``fp32``)."""
    xh = x.to(gl.float16)
    d = (c - xh).to(gl.float32)
    if COSTS == 3:
        d = d - (x - xh.to(gl.float32))
    return gl.fma(d, d, old[:, :, None])


@gluon.jit
def _select(cost, iu3, D: gl.constexpr):
    """(min over u, its lowest u) of (2^D, EH, 2^D) costs through one integer min of the packed keys."""
    low: gl.constexpr = (1 << D) - 1
    key = gl.min((cost.to(gl.int32, bitcast=True) & ~low) | iu3, axis=0)
    return (key & ~low).to(gl.float32, bitcast=True), key & low


@gluon.jit
def _pack(arg, shifts, D: gl.constexpr):
    """One backpointer element per m: the 2^D argmins D bits each (the Triton kernel's row format)."""
    if D <= 2:
        return gl.sum(arg << shifts, axis=1).to(gl.uint8)
    elif D == 3:
        return gl.sum(arg << shifts, axis=1)
    else:
        return gl.sum(arg.to(gl.int64) << shifts.to(gl.int64), axis=1)


@gluon.jit
def forward(x_ptr, table_ptr, bp_ptr, seam_ptr, final_ptr, D: gl.constexpr, FREE: gl.constexpr,
            COSTS: gl.constexpr):
    """One pass of one tile (program): FREE = pass 1 (positions 128..255, 0..127 from a free start, backpointers of
    positions < 128 kept, the edge of the lowest cheapest final state written to final_ptr); else pass 2
    (0..255 from the tile's seam edge). Launched with 8 warps."""
    U: gl.constexpr = 1 << D
    EH: gl.constexpr = 1 << (16 - 2 * D)
    NE: gl.constexpr = 1 << (16 - D)
    L3: gl.constexpr = gl.BlockedLayout([U, 1, U], [1, 32, 1], [1, gl.num_warps(), 1], [2, 1, 0])
    LE: gl.constexpr = gl.SliceLayout(0, L3)  # (EH, U): this step's edge costs
    LO: gl.constexpr = gl.SliceLayout(2, L3)  # (U, EH): the predecessor costs of the next step
    t = gl.program_id(0).to(gl.int64)
    iu = gl.arange(0, U, layout=gl.SliceLayout(1, LO))
    im = gl.arange(0, EH, layout=gl.SliceLayout(0, LO))
    il3 = gl.arange(0, U, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    iu3 = iu[:, None, None]
    state = (iu3 << (16 - D)) | (im[None, :, None] << D) | il3[None, None, :]
    c = gl.load(table_ptr + state)  # c[u, m, l] = codebook(state (u << 16-D) | (m << D) | l), fp16
    row = gl.arange(0, EH, layout=gl.SliceLayout(1, LE))
    il = gl.arange(0, U, layout=gl.SliceLayout(0, LE))
    shifts = (il * D)[None, :]
    edges = gl.allocate_shared_memory(gl.float32, [EH, U], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    if FREE:
        old = gl.zeros((U, EH), gl.float32, LO)
        offset = 128
    else:
        j = (iu[:, None] << (16 - 2 * D)) | im[None, :]  # predecessor edge index (u << 16-2D) | m
        old = gl.where(j == gl.load(seam_ptr + t), 0.0, float("inf"))
        offset = 0
    for i in range(255):
        p = (i + offset) & 255
        new, arg = _select(_costs(c, gl.load(x_ptr + t * 256 + p), old, COSTS), iu3, D)
        gl.store(bp_ptr + (t * 256 + p) * EH + row, _pack(arg, shifts, D), mask=(p < 128) | (not FREE))
        thread_barrier()  # every thread has read the last step's predecessor costs
        edges.store(new)
        thread_barrier()
        old = edges.reshape([U, EH]).load(LO)  # edge j = m·U + l is predecessor (j >> 16-2D, j & EH-1)
    p = (255 + offset) & 255  # the last step: pass 1 picks its final state from these costs
    new, arg = _select(_costs(c, gl.load(x_ptr + t * 256 + p), old, COSTS), iu3, D)
    gl.store(bp_ptr + (t * 256 + p) * EH + row, _pack(arg, shifts, D))
    if FREE:  # the lowest state (u, m, l) among the cheapest; per (m, l), arg is the lowest u of its minimum
        best = gl.min(gl.min(new, axis=1), axis=0)
        s = (arg << (16 - D)) | (row[:, None] << D) | il[None, :]
        s = gl.min(gl.min(gl.where(new == best, s, 65536), axis=1), axis=0)
        gl.store(final_ptr + t, (s & (NE - 1)).to(gl.int32))
