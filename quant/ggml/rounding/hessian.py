"""Hessian-aware rounding inside ggml's block types: the same bytes count and types, a smaller layer-output error.

``quantize_hessian(w, hessian, qtype, imatrix=None)`` returns ggml blocks of ``qtype`` (what
``encoders.quantize`` returns, loadable by llama.cpp unchanged) whose codes minimise the layer-output error
``tr(ΔW·H·ΔWᵀ)`` (H = E[x·xᵀ] of the Linear's input) rather than each weight's own (imatrix-weighted) error.

Method (GPTQ/LDLQ error feedback, blocked as ggml blocks are): columns are taken in order, a ggml block (256
weights of a row for the K-quants, IQ4_XS and the IQ2 and IQ1 types, 32 for the legacy types and IQ4_NL) at a time.
When the walk reaches a block, its scales, mins and super-scales are chosen by mixq's exact ggml encoder (:mod:`encoders`,
with the imatrix or else diag(H) as importance) from the *current* targets, i.e. the weights plus the feedback of
the errors already made; then every column (scalar types; IQ4_NL and IQ4_XS to the nearest of their 16 table
levels) or 8-column codebook group (IQ2_S; IQ2_XS with its count of negative signs kept even; IQ1_S and IQ1_M with
the group's delta kept) is rounded on that grid and its error is fed forward to the columns not yet rounded through the upper Cholesky factor U of H⁻¹
(``targets[:, later] -= err·U⁻¹[group] · U[group, later]``), which is the greedy minimiser of the quadratic
loss column by column. The walk keeps the scales ggml's search gives for those targets, so the block format,
fp16 rounding and llama.cpp decoding are untouched; :mod:`levels` writes the chosen codes back.
``refine`` > 0 then runs that many passes of coordinate descent on the exact quadratic, which the greedy walk
leaves on the table (not for IQ1_S / IQ1_M: their walk is all). Each pass moves, in turn: every code one step up or down (the best of a short list of
codebook entries per IQ2 group); every sub-block's integer scale and min one step (K-quants, IQ2 types, IQ4_XS)
(:func:`refine_sub_scales`); every block's fp16 super-scales to their least-squares optimum
(:func:`refit_super_scales`). Every move is kept only where it lowers the quadratic, and every field stays in its
type's range, so the bytes remain a valid block of the same type. On k256 (128 x 512 calibration tokens,
held-out Hessians), 3 passes of the codes alone take the layer error from 0.76-0.90x ggml's to 0.67-0.85x. The
scale moves take off another 1-4% (most at Q2_K).

Numerics in torch (float64 factorisation, float32 walk), on CUDA when present; routed-expert stacks
(E, rows, n) with one Hessian per expert run batched. On an accelerator nothing in the sweeps waits on the device
(no early exits, the small solves unchecked: H is damped positive definite), and the blocks are decoded there;
where the Triton kernels run, the code descent (:mod:`triton_kernels.refine`, the same codes), the IQ2_S codebook
search (:mod:`triton_kernels.iq2s`), the IQ2_S group descent (:mod:`triton_kernels.iq2s_descent`, the same moves up to
near-ties) and the sub-block scale descent (:mod:`triton_kernels.subscales`, the same moves up to near-ties) are
fused.
"""
from __future__ import annotations

import warnings
from typing import Iterator

import numpy as np
import torch

from mixq.errors import InputError
from mixq.formats.gguf_layout import block_shape
from mixq.quant.device import device_kind, pick_device
from mixq.quant.ggml import encoders
from mixq.quant.ggml.rounding import levels as gl
from mixq.quant.ggml.triton_kernels import (iq2s as triton_iq2s, iq2s_descent as triton_iq2s_descent,
                                            refine as triton_refine, subscales as triton_subscales)
from mixq.quant.ggml.triton_kernels.search import use_fused

SUPPORTED = gl.SCALAR_TYPES + gl.IQ2_TYPES + gl.IQ1_TYPES
DEFAULT_DAMP = 0.01      # relative diagonal damping of H (GPTQ's default): keeps U finite for rank-deficient H
REFIT_SCALES = True      # refinement also moves the scales (refine_sub_scales, refit_super_scales)
LAZY_COLUMNS = 256       # columns updated eagerly; the rest receive the batch's feedback in one matmul


def upper_inverse_factor(hessian: torch.Tensor, damp: float = DEFAULT_DAMP) -> torch.Tensor:
    """U with H⁻¹ = Uᵀ·U (upper triangular), for H (n, n) or (E, n, n), after damping.

    Dead columns (zero diagonal: inputs never seen) get a unit diagonal; a factorisation that fails is retried
    with ten times the damping (a few times), so calibration Hessians of any rank work."""
    h = hessian.to(torch.float64).clone()
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    dead = diag <= 0
    diag[dead] = 1.0
    mean = diag.mean(-1, keepdim=True).clamp_min(1e-30)
    # U = J·L⁻¹·J with J·H·J = L·Lᵀ (J reverses the order): UᵀU = H⁻¹ from one factorisation and one triangular
    # inverse; the Cholesky of H⁻¹ needs H⁻¹ formed first, a third of a 32-expert call on a GPU
    for attempt in range(6):
        lam = damp * (10.0 ** attempt)
        hd = h + torch.diag_embed(lam * mean.expand_as(diag))
        low, info = torch.linalg.cholesky_ex(hd.flip(-2, -1))
        if not bool((info != 0).any()):
            eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device).expand_as(low)
            return torch.linalg.solve_triangular(low, eye, upper=False).flip(-2, -1)
    raise InputError("Hessian is not positive definite even after damping (non-finite calibration data?)")


def _damped(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """H + damp·mean(diag H)·I (float32, (E|1, n, n)): the objective the rounding minimises."""
    h = hessian.to(torch.float32)
    mean = torch.diagonal(h, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)
    return h + damp * mean[..., None, None] * torch.eye(h.shape[-1], device=h.device)


def layer_error(w: torch.Tensor, wq: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """tr(ΔW·H·ΔWᵀ) for W (rows, n) / (E, rows, n), its quantized copy and H (n, n) / (E, n, n); float64."""
    d = (w.to(torch.float64) - wq.to(torch.float64))
    return ((d @ hessian.to(torch.float64)) * d).sum(dim=(-2, -1))


def dequantize_blocks(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """float32 weights of ggml blocks (..., bytes per row), decoded on the host (gguf-py's values bit for bit)."""
    return gl.decode_blocks(blocks, qtype).numpy()


def _any(mask: torch.Tensor) -> bool:
    """Whether a sweep step moves anything. Only asked on the CPU: on an accelerator the answer would stall the
    queue of kernels once per column, and applying a step that moves nothing leaves every value as it was."""
    return mask.device.type != "cpu" or bool(mask.any())


# columns whose gradient a sweep keeps current, per device type; the others receive the window's changes in one
# matmul when the sweep leaves it (the same sums in another order: on a GPU the full-width update of every step
# was most of the sweeps' time). None: every column at every step (the CPU, whose bytes this leaves as they were)
FEEDBACK_WINDOW = {"cpu": None, "accelerator": 256}


class _Feedback:
    """The gradient (W − Ŵ)·H of a coordinate-descent sweep in column order, kept current where the sweep reads it.

    A step that changes Ŵ's columns `cols` by −c (c: the change of W − Ŵ) adds c·H[cols, :] to the gradient: to the
    current window's columns at once, to the others once the sweep leaves the window (`window` >= n: to every column
    at once, the CPU's order)."""

    def __init__(self, grad: torch.Tensor, hessian: torch.Tensor, window: int) -> None:
        self.grad, self.h, self.n = grad, hessian, grad.shape[-1]
        self.size = min(window, self.n)
        self.w0, self.w1 = 0, self.size
        self.pending = None if self.size >= self.n else torch.zeros(
            *grad.shape[:-1], self.size, dtype=grad.dtype, device=grad.device)

    def at(self, cols: slice) -> torch.Tensor:
        """The current gradient of columns `cols` (inside one window), moving the window there first."""
        if not self.w0 <= cols.start < self.w1:
            self.flush()
            self.w0 = cols.start // self.size * self.size
            self.w1 = min(self.n, self.w0 + self.size)
        return self.grad[..., cols]

    def add(self, cols: slice, change: torch.Tensor) -> None:
        """Ŵ's columns `cols` (the window's, after `at`) changed so that W − Ŵ changed by `change` (E, rows, k)."""
        w0, w1 = self.w0, self.w1
        if cols.stop - cols.start == 1:  # one column: an outer product
            self.grad[..., w0:w1] += change * self.h[:, cols.start, w0:w1].unsqueeze(1)
        else:
            self.grad[..., w0:w1] += change @ self.h[:, cols, w0:w1]
        if self.pending is not None:
            self.pending[..., cols.start - w0:cols.stop - w0] += change

    def windows(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(first column, width, changes buffer) of every window in column order, the window moved there first: the
        walk of the fused kernels, one launch per window, each writing its window's changes of W − Ŵ to the buffer
        (`pending`; where one window is the whole row, a scratch buffer nothing reads)."""
        buf = self.pending if self.pending is not None else torch.zeros(
            *self.grad.shape[:-1], self.size, dtype=self.grad.dtype, device=self.grad.device)
        for w0 in range(0, self.n, self.size):
            self.at(slice(w0, w0 + 1))
            yield w0, self.w1 - w0, buf

    def flush(self) -> None:
        """Bring every column's gradient up to date (the end of a sweep)."""
        if self.pending is None:
            return
        w0, w1 = self.w0, self.w1
        d = self.pending[..., :w1 - w0]
        if w0 > 0:
            self.grad[..., :w0] += d @ self.h[:, w0:w1, :w0]
        if w1 < self.n:
            self.grad[..., w1:] += d @ self.h[:, w0:w1, w1:]
        self.pending.zero_()


def _window(dev: torch.device, n: int) -> int:
    size = FEEDBACK_WINDOW[device_kind(dev)]
    return n if size is None else size


def _encode_block(x: torch.Tensor, qtype: str, importance: np.ndarray) -> np.ndarray:
    """ggml's own encoding of targets x (E, rows, width) with per-expert importance (E, width); on an accelerator
    through the torch encoders (same bytes), in one call for every row of every expert."""
    E, R, n = x.shape
    if x.device.type != "cpu":
        im = torch.from_numpy(np.ascontiguousarray(importance, dtype=np.float32)).to(x.device)
        b = encoders.quantize_tensor(x.detach().float().reshape(E * R, n), qtype,
                                    im[:, None, :].expand(E, R, n).reshape(E * R, n))
        return b.reshape(E, R, -1).cpu().numpy()
    xs = x.detach().to("cpu", torch.float32).numpy()
    return np.stack([encoders.quantize(xs[e], qtype, importance[e]) for e in range(E)])


class _ScalarRounder:
    """Rounds one column at a time on a scalar grid (decode = step·value(code) + base)."""
    group = 1

    def __init__(self, qtype: str, device: torch.device) -> None:
        self.qtype, self.device = qtype, device
        self.lo, self.hi = gl.CODE_RANGE[qtype]

    def start(self, blocks: np.ndarray) -> None:
        self.step, self.base = gl.level_grid_on(blocks, self.qtype, self.device)
        self.codes = torch.zeros(self.step.shape, dtype=torch.int64, device=self.device)

    def round(self, t: torch.Tensor, j: int, metric: torch.Tensor) -> torch.Tensor:
        """Targets t (E, rows, 1) of block column j -> decoded values (E, rows, 1); codes kept."""
        step, base = self.step[..., j:j + 1], self.base[..., j:j + 1]
        safe = torch.where(step != 0, step, torch.ones_like(step))
        c = gl.nearest_codes((t - base) / safe, self.qtype)
        c = torch.where(step != 0, c, torch.full_like(c, max(self.lo, 0)))
        self.codes[..., j:j + 1] = c.long()
        return step * gl.code_values(c, self.qtype) + base

    def finish(self, blocks: np.ndarray) -> np.ndarray:
        return gl.set_levels_on(blocks, self.qtype, self.codes)


class _IQ2Rounder:
    """Rounds 8-column groups on an IQ2 codebook: signs follow the targets, the magnitude tuple is the codebook
    entry with the smallest metric-weighted squared error. Where the type stores 7 sign bits (IQ2_XS), a group
    with an odd count of negative targets also flips the weight whose flip costs least, and the entry is the best
    of ``IQ2_SHORTLIST`` with that flip priced in."""
    group = 8

    def __init__(self, qtype: str, device: torch.device) -> None:
        self.qtype = qtype
        self.device = device
        self.parity = gl.IQ2_LAYOUTS[qtype].parity
        self.grid = torch.from_numpy(gl.iq2_grid(qtype)).to(device)  # (entries, 8)

    def start(self, blocks: np.ndarray) -> None:
        self.db = gl.iq2_group_scales_on(blocks, self.qtype, self.device)  # (E, rows, 32)
        self.index = torch.zeros(self.db.shape, dtype=torch.int64, device=self.device)
        self.signs = torch.zeros(self.db.shape, dtype=torch.int64, device=self.device)
        self.bits = (2 ** torch.arange(8, device=self.device)).view(1, 1, 8)

    def round(self, t: torch.Tensor, j: int, metric: torch.Tensor) -> torch.Tensor:
        g = j // 8
        db = self.db[..., g:g + 1]                                   # (E, rows, 1)
        neg = t < 0
        if self.parity:
            k, neg = _even_entries(db, metric, t, self.grid)
        else:
            k = nearest_iq2_entries(db, metric, t, self.grid, 1)[..., 0]   # (E, rows)
        self.index[..., g] = k
        self.signs[..., g] = (neg.long() * self.bits).sum(-1)
        return db * self.grid[k] * torch.where(neg, -1.0, 1.0)

    def finish(self, blocks: np.ndarray) -> np.ndarray:
        return gl.set_iq2_groups_on(blocks, self.qtype, self.index, self.signs)


class _IQ1Rounder:
    """Rounds 8-column groups on the IQ1 ternary codebook: with the group's scale db and delta kept (as ggml's search
    chose them for the current targets), the entry with the smallest metric-weighted squared error of
    db·(grid + delta) against the targets."""
    group = 8

    def __init__(self, qtype: str, device: torch.device) -> None:
        self.qtype, self.device = qtype, device
        self.grid = torch.from_numpy(gl.iq1_grid()).to(device)                  # (entries, 8)
        self.grid2 = self.grid * self.grid

    def start(self, blocks: np.ndarray) -> None:
        self.index, self.db, self.delta = gl.iq1_groups_on(blocks, self.qtype, self.device)   # (E, rows, 32)

    def round(self, t: torch.Tensor, j: int, metric: torch.Tensor) -> torch.Tensor:
        g = j // 8
        db, dl = self.db[..., g:g + 1], self.delta[..., g:g + 1]                 # (E, rows, 1)
        # Σ m·(db·(c + dl) - t)² over the group = db²·Σ m·c² + 2·db·Σ m·c·(db·dl - t) + a constant
        r = db * dl - t                                                          # (E, rows, 8)
        m = metric.unsqueeze(-2)                                                 # (E|1, 1, 8)
        score = db * db * (m @ self.grid2.T) + 2 * db * ((m * r) @ self.grid.T)  # (E, rows, entries)
        k = torch.argmin(score, dim=-1)
        self.index[..., g] = k
        return db * (self.grid[k] + dl)

    def finish(self, blocks: np.ndarray) -> np.ndarray:
        return gl.set_iq1_groups_on(blocks, self.qtype, self.index)


def _shortlist(db: torch.Tensor, metric: torch.Tensor, t: torch.Tensor, grid: torch.Tensor,
               parity: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``IQ2_SHORTLIST`` codebook entries nearest to the groups' |t| (E, rows, 8) at scales db (E, rows, 1) in
    the diagonal metric (E|1, 8), each with its signs: (entries (E, rows, K), their magnitudes (E, rows, K, 8),
    negative weights (E, rows, K, 8), the signs' extra cost (E, rows, K)). The signs follow t; where the codebook
    keeps an even count of negatives (`parity`) and t's count is odd, the weight whose flip costs least in the
    metric (4·db·m_i·|t_i|·c_i) flips, per entry."""
    k = nearest_iq2_entries(db, metric, t, grid, IQ2_SHORTLIST)               # (E, rows, K)
    c = grid[k]                                                               # (E, rows, K, 8)
    neg = (t < 0).unsqueeze(-2).expand(c.shape)
    if not parity:
        return k, c, neg, torch.zeros(k.shape, device=t.device)
    a = (metric.unsqueeze(-2) * t.abs()).unsqueeze(-2)                        # (E, rows, 1, 8)
    neg, cost = gl.even_sign_flip(neg, 4 * db.unsqueeze(-1) * a * c)
    return k, c, neg, cost


def _even_entries(db: torch.Tensor, metric: torch.Tensor, t: torch.Tensor,
                  grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(entry (E, rows), negative weights (E, rows, 8)) of the groups' targets t (E, rows, 8) on a codebook whose
    signs keep an even count of negatives: of :func:`_shortlist`'s entries, the one of least diagonal-metric error
    (s²·Σm·c² − 2s·Σm·|t|·c) plus its flip's cost."""
    k, c, neg, flip_cost = _shortlist(db, metric, t, grid, True)
    a = (metric.unsqueeze(-2) * t.abs()).unsqueeze(-2)                        # (E, rows, 1, 8)
    m = metric.unsqueeze(-2).unsqueeze(-2)
    score = diagonal_score(db, (m * c * c).sum(-1), (a * c).sum(-1))         # (E, rows, K)
    best = (score + flip_cost).argmin(-1, keepdim=True)                       # (E, rows, 1)
    chosen = neg.gather(-2, best.unsqueeze(-1).expand(*best.shape, 8)).squeeze(-2)
    return k.gather(-1, best).squeeze(-1), chosen


def _check(w: torch.Tensor, hessian: torch.Tensor, qtype: str, imatrix) -> tuple[torch.Tensor, torch.Tensor]:
    if qtype not in SUPPORTED:
        raise InputError(f"Hessian rounding does not support {qtype!r}; supported: {', '.join(SUPPORTED)}")
    if w.ndim not in (2, 3):
        raise InputError(f"quantize_hessian: expected (rows, n) or (E, rows, n) weights, got shape {tuple(w.shape)}")
    stacked = w.ndim == 3
    w3 = w if stacked else w.unsqueeze(0)
    n = w3.shape[-1]
    bs = block_shape(qtype)[0]
    if n % bs:
        raise InputError(f"quantize_hessian: row length {n} is not a multiple of {bs} ({qtype})")
    h3 = hessian if hessian.ndim == 3 else hessian.unsqueeze(0)
    if h3.shape[-2:] != (n, n) or h3.shape[0] not in (1, w3.shape[0]):
        raise InputError(f"quantize_hessian: Hessian shape {tuple(hessian.shape)} does not fit weights "
                         f"{tuple(w.shape)}")
    if not bool(torch.isfinite(w3).all()) or not bool(torch.isfinite(h3).all()):
        raise InputError("quantize_hessian: weights or Hessian contain NaN or infinite values")
    return w3, h3


def _importance(imatrix, h3: torch.Tensor, experts: int, n: int) -> np.ndarray:
    """Per-expert column importance for ggml's scale search: the imatrix, else diag(H)."""
    if imatrix is None:
        d = torch.diagonal(h3, dim1=-2, dim2=-1).to("cpu", torch.float32).clamp_min(0).numpy()
        return np.broadcast_to(d, (experts, n)).copy()
    im = np.asarray(imatrix, dtype=np.float32)
    if im.size not in (n, experts * n):
        raise InputError(f"quantize_hessian: imatrix has {im.size} values, expected {n} or {experts}x{n}")
    return np.broadcast_to(im.reshape(-1, n), (experts, n)).copy()


def refine_codes(w: torch.Tensor, blocks: np.ndarray, qtype: str, hessian: torch.Tensor,
                 passes: int = 1) -> np.ndarray:
    """Coordinate descent on the level codes of scalar-type ``blocks`` (scales kept) for tr(ΔW·H·ΔWᵀ).

    Sweeps the columns in order; every weight moves one code up or down when that lowers the quadratic (exactly:
    ΔL = −2v·(ΔW·H)_j + v²·H_jj for a decoded change v), vectorised over rows and experts. w (E, rows, n),
    H (E|1, n, n) float32."""
    lo, hi = gl.CODE_RANGE[qtype]
    dev = w.device
    step, base = gl.level_grid_on(blocks, qtype, dev)
    deq = gl.decode_blocks(blocks, qtype, dev).reshape(w.shape)
    safe = torch.where(step != 0, step, torch.ones_like(step))
    codes = torch.where(step != 0, gl.nearest_codes((deq - base) / safe, qtype), torch.full_like(step, lo))
    err = w - deq
    grad = err @ hessian                                                   # (E, rows, n): (ΔW·H)
    hdiag = torch.diagonal(hessian, dim1=-2, dim2=-1).unsqueeze(-2)         # (E|1, 1, n)
    live = step != 0
    fused = use_fused(w)
    fb = _Feedback(grad, hessian.contiguous() if fused else hessian, _window(dev, w.shape[-1]))
    sweep = _fused_code_pass if fused else _code_pass
    for _ in range(passes):
        # what a column's move depends on besides the gradient: fixed for the pass, since a column's code changes
        # only at its own turn (computed for all columns at once; per column the same values as one at a time)
        val = gl.code_values(codes, qtype)
        up = step * (gl.code_values((codes + 1).clamp(max=hi), qtype) - val)   # decoded change of code + 1
        dn = step * (gl.code_values((codes - 1).clamp(min=lo), qtype) - val)   # ... of code - 1
        up_h, dn_h = up * hdiag, dn * hdiag
        ok_up, ok_dn = (codes < hi) & live, (codes > lo) & live
        sweep(fb, codes, up, dn, up_h, dn_h, ok_up, ok_dn)
        fb.flush()
    return gl.set_levels_on(blocks, qtype, codes.long())


def _code_pass(fb: _Feedback, codes, up, dn, up_h, dn_h, ok_up, ok_dn) -> None:
    """One pass of :func:`refine_codes`' sweep, column by column (codes and gradient updated in place)."""
    for j in range(codes.shape[-1]):
        g2 = 2 * fb.at(slice(j, j + 1))[..., 0]
        d_up = torch.where(ok_up[..., j], up[..., j] * (up_h[..., j] - g2), 0.0)
        d_dn = torch.where(ok_dn[..., j], dn[..., j] * (dn_h[..., j] - g2), 0.0)
        move = torch.where((d_up < d_dn) & (d_up < 0), 1.0, torch.where(d_dn < 0, -1.0, 0.0))
        if not _any(move != 0):
            continue
        delta = -torch.where(move > 0, up[..., j], torch.where(move < 0, dn[..., j], 0.0))  # error change
        codes[..., j] += move
        fb.add(slice(j, j + 1), delta.unsqueeze(-1))


def _fused_code_pass(fb: _Feedback, codes, up, dn, up_h, dn_h, ok_up, ok_dn) -> None:
    """One pass of :func:`refine_codes`' sweep through the fused kernel, one launch per feedback window (the same
    codes and gradient as :func:`_code_pass`: triton_refine; the Hessian contiguous)."""
    args = [t.contiguous() for t in (up, dn, up_h, dn_h)] + \
        [ok_up.to(torch.int8).contiguous(), ok_dn.to(torch.int8).contiguous()]
    for w0, width, pending in fb.windows():
        triton_refine.code_window(fb.grad, fb.h, codes, *args, pending, w0, width)


def refine_sub_scales(w: torch.Tensor, blocks: np.ndarray, qtype: str, hessian: torch.Tensor) -> np.ndarray:
    """Coordinate descent on the K-quant / IQ2_S sub-block scales and mins (codes and fp16 super-scales kept) for
    tr(ΔW·H·ΔWᵀ): each sub-block in column order tries its integer scale ±1 and min ±1 (a decoded weight is
    linear in both, slopes read through the decoder) and takes the move that lowers the exact quadratic most
    (−2Δ·g + ΔᵀH_ssΔ, g = (W − Ŵ)·H), for all rows and experts at once; where the Triton kernels run, one fused
    launch per feedback window (:func:`_fused_sub_scales`). w (E, rows, n), H (E|1, n, n) float32."""
    dev = w.device
    sub, (slo, shi), mrange = gl.SUB_SCALES[qtype]
    sc, mn = gl.sub_scales(blocks, qtype)
    raw = torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.uint8)).to(dev)
    deq = gl.decode_blocks(raw, qtype, dev)
    sc_t = torch.from_numpy(sc).to(dev)
    mn_t = None if mn is None else torch.from_numpy(mn).to(dev)

    def slope(moved_sc, moved_mn, delta):  # per weight: change of the decoded weight per unit of the field
        diff = gl.decode_blocks(gl.set_sub_scales_on(raw, qtype, moved_sc, moved_mn), qtype, dev) - deq
        per = delta.to(torch.float64).repeat_interleave(sub, dim=-1)                 # widened there
        return (diff.double() / per).float().reshape(w.shape)

    fields = []  # (values, range, slope per weight)
    up = torch.where(sc_t < shi, sc_t + 1, sc_t - 1)
    fields.append([sc_t.reshape(*w.shape[:-1], -1), (slo, shi), slope(up, mn_t, up - sc_t)])
    if mrange is not None:
        upm = torch.where(mn_t < mrange[1], mn_t + 1, mn_t - 1)
        fields.append([mn_t.reshape(*w.shape[:-1], -1), mrange, slope(sc_t, upm, upm - mn_t)])
    deq = deq.reshape(w.shape)
    if use_fused(w) and fused_sweep_ok("sub_scales", dev):  # one launch per window, `fields` moved in place
        _fused_sub_scales(w, deq, hessian.contiguous(), fields, sub)
        return gl.set_sub_scales_on(raw, qtype, *(f[0] for f in fields)).cpu().numpy()
    fb = _Feedback((w - deq) @ hessian, hessian, _window(dev, w.shape[-1]))        # (E, rows, n)
    for j in range(w.shape[-1] // sub):
        cols = slice(j * sub, (j + 1) * sub)
        hss = hessian[:, cols, cols]                                                # (E|1, sub, sub)
        g = fb.at(cols)
        best = torch.zeros(w.shape[:-1], device=dev)
        choice = torch.full(w.shape[:-1], -1, dtype=torch.long, device=dev)
        for f, (vals, (lo, hi), sl) in enumerate(fields):
            a = sl[..., cols]                                                       # (E, rows, sub)
            lin = (a * g).sum(-1)
            quad = ((a @ hss) * a).sum(-1)
            for k, sign in enumerate((1, -1)):
                ok = (vals[..., j] + sign >= lo) & (vals[..., j] + sign <= hi)
                dl = torch.where(ok, -2 * sign * lin + quad, torch.zeros_like(lin))
                better = dl < best
                best = torch.where(better, dl, best)
                choice = torch.where(better, 2 * f + k, choice)
        if not _any(choice >= 0):
            continue
        step = torch.zeros_like(g)
        for f, (vals, _, sl) in enumerate(fields):
            for k, sign in enumerate((1, -1)):
                pick = choice == 2 * f + k
                vals[..., j] += sign * pick.long()
                step += sign * pick.unsqueeze(-1) * sl[..., cols]
        fb.add(cols, -step)
    out_mn = fields[1][0] if mrange is not None else None
    return gl.set_sub_scales_on(raw, qtype, fields[0][0], out_mn).cpu().numpy()


def _fused_sub_scales(w: torch.Tensor, deq: torch.Tensor, hessian: torch.Tensor, fields: list, sub: int) -> None:
    """:func:`refine_sub_scales`' sweep through the fused kernel, one launch per feedback window (triton_subscales:
    the same step per sub-block, up to the order of the sums; the Hessian contiguous). `fields` ([values, range,
    slope] for the scale and the min, if any) as refine_sub_scales makes them; their values are updated in place."""
    fb = _Feedback((w - deq) @ hessian, hessian, _window(w.device, w.shape[-1]))
    for f in fields:
        f[0] = f[0].contiguous()
    none = [None] * (2 - len(fields))  # no min: its arguments None
    vals, ranges = [f[0] for f in fields] + none, [f[1] for f in fields] + none
    slopes = [f[2].contiguous() for f in fields]
    hss = diagonal_blocks(hessian, sub)
    quads = [triton_subscales.sub_block_quads(a, hss) for a in slopes] + none
    slopes += none
    for w0, width, pending in fb.windows():
        triton_subscales.sub_scale_window(fb.grad, fb.h, vals[0], vals[1], slopes[0], slopes[1], quads[0], quads[1],
                                          pending, w0, width, sub, ranges[0], ranges[1])


def refit_super_scales(w: torch.Tensor, blocks: np.ndarray, qtype: str, hessian: torch.Tensor) -> np.ndarray:
    """Refit every block's fp16 super-scales (d, and dmin / m) for tr(ΔW·H·ΔWᵀ), codes and packed scales kept.

    A block's weights are linear in its k super-scales (y = Σ scale_i·A_i), so given the other blocks the best
    scales solve a k x k system (A_i·H_bb·A_jᵀ) δ = A_i·g_b with g = (W − Ŵ)·H. Blocks are taken in column order
    (all rows and experts at once); the fp16-rounded result replaces a block's scales only when it lowers the
    exact quadratic. w (E, rows, n), H (E|1, n, n) float32."""
    dev = w.device
    bs = block_shape(qtype)[0]
    scales = torch.from_numpy(gl.super_scales(blocks, qtype)).to(dev)               # (E, rows, nb, k)
    basis = gl.super_scale_basis_on(blocks, qtype, dev)                             # (k, E, rows, n)
    deq = torch.einsum("erbk,kerbc->erbc", scales, basis.unflatten(-1, (-1, bs))).flatten(-2)
    grad = (w - deq) @ hessian                                                      # (E, rows, n)
    k = scales.shape[-1]
    eye = torch.eye(k, device=dev)
    for b in range(w.shape[-1] // bs):
        cols = slice(b * bs, (b + 1) * bs)
        a = basis[..., cols]                                                        # (k, E, rows, bs)
        ha = torch.einsum("kerc,ecd->kerd", a, hessian[:, cols, cols].expand(w.shape[0], bs, bs))
        m = torch.einsum("kerd,lerd->erkl", ha, a)                                  # (E, rows, k, k)
        r = torch.einsum("kerc,erc->erk", a, grad[..., cols])                       # (E, rows, k)
        tr = torch.diagonal(m, dim1=-2, dim2=-1).sum(-1).clamp_min(1e-30)
        delta = torch.linalg.solve_ex(m + 1e-9 * tr[..., None, None] * eye, r.unsqueeze(-1))[0].squeeze(-1)
        old = scales[..., b, :]
        new = (old + delta).clamp(-65504.0, 65504.0).to(torch.float16).to(torch.float32)
        d = new - old
        dl = -2 * (d * r).sum(-1) + torch.einsum("erk,erkl,erl->er", d, m, d)       # change of the quadratic
        take = torch.isfinite(dl) & (dl < 0)
        if not _any(take):
            continue
        d = torch.where(take.unsqueeze(-1), d, torch.zeros_like(d))
        scales[..., b, :] = old + d
        step = torch.einsum("erk,kerc->erc", d, a)                                  # Ŵ change in this block
        grad -= step @ hessian[:, cols, :]
    return gl.set_super_scales(blocks, qtype, scales.cpu().numpy())


IQ2_SHORTLIST = 8  # codebook entries per group scored with the exact quadratic (after a diagonal pre-selection)


def smallest_by_argmin(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k smallest entries of the last dim, ascending, in k passes of argmin (`x` is overwritten):
    topk's indices (ties aside) where torch's topk was most of an IQ2_S sweep's time on a GPU (1024 entries, k = 8)."""
    out = []
    for _ in range(k):
        i = x.argmin(-1, keepdim=True)
        out.append(i)
        x.scatter_(-1, i, float("inf"))
    return torch.cat(out, -1)


def diagonal_blocks(m: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` x `size` diagonal blocks of matrices m (E|1, n, n), gathered in one call: (E|1, n / size, size,
    size)."""
    at = torch.arange(m.shape[-1], device=m.device).view(-1, size)
    return m[:, at[:, :, None], at[:, None, :]]


def diagonal_score(scale: torch.Tensor, mcc: torch.Tensor, mtc: torch.Tensor) -> torch.Tensor:
    """An entry's error in the diagonal metric, less the constant Σm·t²: s²·Σm·c² − 2s·Σm·|t|·c, from its two sums
    (`mcc` = Σm·c², `mtc` = Σm·|t|·c) at scale s."""
    return scale * scale * mcc - 2 * scale * mtc


def nearest_iq2_entries(scale: torch.Tensor, metric: torch.Tensor, target: torch.Tensor, grid: torch.Tensor,
                        k: int) -> torch.Tensor:
    """Indices (E, rows, k), ascending, of the IQ2 codebook entries (grid (entries, 8)) nearest to the groups'
    |target| (E, rows, 8) at scale (E, rows, 1) in the diagonal metric (E|1, 8): smallest s²·Σm·c² − 2s·Σm·|t|·c.
    Fused where the Triton kernels run (triton_iq2s), else one score table: topk on the CPU, k passes of argmin
    elsewhere."""
    if use_fused(target):
        return triton_iq2s.nearest_entries(scale, metric, target, grid, k)
    score = diagonal_score(scale, ((grid * grid) @ metric.unsqueeze(-1)).transpose(-1, -2),
                           (metric.unsqueeze(-2) * target.abs()) @ grid.T)  # (E, rows, entries)
    if k == 1:
        return score.argmin(-1, keepdim=True)
    if score.device.type == "cpu":
        return score.topk(k, dim=-1, largest=False).indices
    return smallest_by_argmin(score, k)


def refine_iq2(w: torch.Tensor, blocks: np.ndarray, qtype: str, hessian: torch.Tensor, passes: int = 1) -> np.ndarray:
    """Group-wise descent on IQ2 blocks (scales kept) for tr(ΔW·H·ΔWᵀ).

    For each 8-weight group in turn: the unconstrained best values given the other groups (v + H_BB⁻¹·g_B) fix the
    signs (IQ2_XS: with the cheapest flip in the diagonal metric where their count of negatives is odd, per
    candidate); the ``IQ2_SHORTLIST`` codebook entries nearest to them in the diagonal metric are scored with the
    exact change of the quadratic (2δ·g_B + δ·H_BB·δᵀ); the best replaces the group's entry when it lowers it.
    IQ2_S, where the Triton kernels run and its fused kernel serves: one fused launch per feedback window
    (:func:`_fused_iq2s`); elsewhere the loop below."""
    dev = w.device
    parity = gl.IQ2_LAYOUTS[qtype].parity
    grid = torch.from_numpy(gl.iq2_grid(qtype)).to(dev)                           # (entries, 8)
    db = gl.iq2_group_scales_on(blocks, qtype, dev)                                # (E, rows, G)
    index, signs = gl.iq2_groups_on(blocks, qtype, dev)
    bits = 2 ** torch.arange(8, device=dev)
    val = gl.decode_blocks(blocks, qtype, dev).reshape(w.shape)
    if qtype == "IQ2_S" and use_fused(w) and fused_sweep_ok("iq2s", dev):
        return _fused_iq2s(w, blocks, hessian.contiguous(), grid, db, index, signs, val, passes)
    fb = _Feedback((w - val) @ hessian, hessian, _window(dev, w.shape[-1]))       # (E, rows, n)
    # every group's H_BB factorised once, in one call (its solves as solve_ex's: the same LU, then lu_solve)
    lu, pivots = torch.linalg.lu_factor(diagonal_blocks(hessian, 8))             # (E|1, groups, 8, 8)
    for _ in range(passes):
        for g in range(w.shape[-1] // 8):
            cols = slice(8 * g, 8 * g + 8)
            hbb = hessian[:, cols, cols]                                           # (E|1, 8, 8)
            v, gb, d = val[..., cols], fb.at(cols), db[..., g:g + 1]
            ideal = v + torch.linalg.lu_solve(lu[:, g], pivots[:, g], gb.transpose(-1, -2)).transpose(-1, -2)
            k, mags, neg, _ = _shortlist(d, torch.diagonal(hbb, dim1=-2, dim2=-1), ideal, grid, parity)
            cand = d.unsqueeze(-1) * mags * torch.where(neg, -1.0, 1.0)            # (E, rows, K, 8)
            delta = v.unsqueeze(-2) - cand                                         # error change per candidate
            dl = 2 * (delta * gb.unsqueeze(-2)).sum(-1) \
                + torch.einsum("erki,eij,erkj->erk", delta, hbb.expand(w.shape[0], 8, 8), delta)
            best = dl.argmin(-1, keepdim=True)                                     # (E, rows, 1)
            take = dl.gather(-1, best).squeeze(-1) < 0
            if not _any(take):
                continue
            pick = best.unsqueeze(-1).expand(*best.shape, 8)
            new_v = cand.gather(-2, pick).squeeze(-2)
            step = torch.where(take.unsqueeze(-1), v - new_v, torch.zeros_like(v))
            fb.add(cols, step)
            val[..., cols] = torch.where(take.unsqueeze(-1), new_v, v)
            index[..., g] = torch.where(take, k.gather(-1, best).squeeze(-1), index[..., g])
            new_signs = (neg.gather(-2, pick).squeeze(-2).long() * bits).sum(-1)
            signs[..., g] = torch.where(take, new_signs, signs[..., g])
    return gl.set_iq2_groups_on(blocks, qtype, index, signs)


def _fused_iq2s(w: torch.Tensor, blocks: np.ndarray, hessian: torch.Tensor, grid: torch.Tensor, db: torch.Tensor,
                index: torch.Tensor, signs: torch.Tensor, val: torch.Tensor, passes: int) -> np.ndarray:
    """:func:`refine_iq2`'s IQ2_S passes through the fused kernel, one launch per feedback window (triton_iq2s_descent:
    the same step per group, up to the order of the sums and an inverse of H_BB made once; the Hessian contiguous)."""
    val = val.contiguous()
    fb = _Feedback((w - val) @ hessian, hessian, _window(w.device, w.shape[-1]))
    hinv = triton_iq2s_descent.group_inverses(diagonal_blocks(hessian, 8))
    db, index, signs = db.contiguous(), index.contiguous(), signs.contiguous()
    grid_t = grid.T.contiguous()
    for _ in range(passes):
        for w0, width, pending in fb.windows():
            triton_iq2s_descent.iq2s_window(fb.grad, fb.h, hinv, val, db, index, signs, grid, grid_t, pending, w0,
                                            width, IQ2_SHORTLIST)
    return gl.set_iq2_groups_on(blocks, "IQ2_S", index, signs)


# per (sweep, device): whether its fused kernel serves there (a test may clear it)
FUSED_SWEEPS: dict[tuple[str, str], bool] = {}
# per sweep: whether its fused kernel serves by default, once it passes its first-use check. The fused IQ2_S group
# descent does not: on a GPU its 3 passes over a 32-expert stack of 2048 x 4096 were far slower than the loop's
# (bench/results/hessian_rounding_speed_h200_iq2s_fused.json); it runs where a caller asks
# for it (allow_fused_sweep: the bench and the tests).
FUSED_BY_DEFAULT = {"iq2s": False, "sub_scales": True}
# the check's problem: experts, rows, columns (one feedback window on an accelerator), and its sweep's type
_CHECK_SHAPE = (2, 16, 256)
_CHECK_TYPE = {"iq2s": "IQ2_S", "sub_scales": "Q4_K"}


def fused_sweep_ok(sweep: str, dev: torch.device) -> bool:
    """Whether the fused kernel of `sweep` ("iq2s": the IQ2_S group descent; "sub_scales": the sub-block scale
    descent) serves `dev`: decided on its first use there, by :func:`allow_fused_sweep` where the sweep's kernel
    serves by default (``FUSED_BY_DEFAULT``), else no."""
    key = (sweep, str(dev))
    if key not in FUSED_SWEEPS:
        FUSED_SWEEPS[key] = FUSED_BY_DEFAULT[sweep] and allow_fused_sweep(sweep, dev)
    return FUSED_SWEEPS[key]


def allow_fused_sweep(sweep: str, dev: torch.device) -> bool:
    """Let the fused kernel of `sweep` serve `dev` for the process if it passes its check: it refines one small
    random problem beside the loop it replaces; a compile error, or a layer error more than 1e-3 above the loop's,
    keeps the loop (with a warning): a kernel is trusted after its check, as the fused searches and the fused
    Viterbi are. Returns whether it serves."""
    key = (sweep, str(dev))
    FUSED_SWEEPS[key] = False  # the check's own calls (and a failing one) take the loop
    try:
        fused, loop = _check_sweep(sweep, dev)
        ok = bool(np.isfinite(fused)) and fused <= loop * (1 + 1e-3) + 1e-12
        if not ok:
            warnings.warn(f"hessian rounding: the fused {sweep} sweep's layer error {fused:.6g} is above the "
                          f"loop's {loop:.6g} on {dev}; using the loop")
        FUSED_SWEEPS[key] = ok
    except Exception as exc:  # noqa: BLE001 - a compile or launch failure: the loop is always correct
        FUSED_SWEEPS[key] = False
        warnings.warn(f"hessian rounding: the fused {sweep} sweep is unavailable on {dev} ({exc!r}); using the loop")
    return FUSED_SWEEPS[key]


def _check_sweep(sweep: str, dev: torch.device) -> tuple[float, float]:
    """Layer errors of the fused sweep and of the loop (the fused flag set by hand) on one random problem."""
    E, R, n = _CHECK_SHAPE
    qtype = _CHECK_TYPE[sweep]
    g = torch.Generator().manual_seed(7)
    w = torch.randn(E, R, n, generator=g) * 0.02
    x = torch.randn(E, 2 * n, n, generator=g)
    h = x.mT @ x / x.shape[1] + 0.1 * torch.eye(n)
    blocks = np.stack([encoders.quantize(w[e].numpy(), qtype) for e in range(E)])
    w, h = w.to(dev), h.to(dev).contiguous()
    errors = []
    for fused in (True, False):
        FUSED_SWEEPS[(sweep, str(dev))] = fused
        out = refine_iq2(w, blocks, qtype, h) if sweep == "iq2s" else refine_sub_scales(w, blocks, qtype, h)
        errors.append(float(layer_error(w, gl.decode_blocks(out, qtype, dev).reshape(w.shape), h).sum()))
    return errors[0], errors[1]


def quantize_hessian(w, hessian, qtype: str, imatrix=None, *, damp: float = DEFAULT_DAMP, refine: int = 0,
                     device: str | torch.device | None = None) -> np.ndarray:
    """Encode W as ``qtype`` blocks, choosing codes for the smallest tr(ΔW·H·ΔWᵀ) (module docstring).

    Args:
        w: float weights (rows, n), or a routed-expert stack (E, rows, n); torch tensor or numpy array.
        hessian: H = mean x·xᵀ of the input, (n, n), or one per expert (E, n, n).
        qtype: a ggml type in ``SUPPORTED``.
        imatrix: optional per-column importance (n,) or (E, n) / (E*n,) for ggml's scale search (default diag H).
        damp: diagonal damping relative to mean(diag H).
    Returns:
        uint8 (rows, bytes per row) or (E, rows, bytes per row), exactly the layout ``encoders.quantize`` returns.
    """
    dev = pick_device(device)
    # on the device before the checks: its finiteness scan runs there, and 16-bit weights cross as stored
    w = torch.as_tensor(np.asarray(w) if not isinstance(w, torch.Tensor) else w).to(dev)
    hessian = torch.as_tensor(np.asarray(hessian) if not isinstance(hessian, torch.Tensor) else hessian)
    w3, h3 = _check(w, hessian, qtype, imatrix)
    E, R, n = w3.shape
    importance = _importance(imatrix, h3, E, n)
    u = upper_inverse_factor(h3.to(dev), damp).to(torch.float32)          # (E|1, n, n)
    targets = w3.to(dev, torch.float32).clone()
    bs, ts = block_shape(qtype)
    rounder = (_IQ2Rounder if qtype in gl.IQ2_LAYOUTS else _IQ1Rounder if qtype in gl.IQ1_TYPES
               else _ScalarRounder)(qtype, dev)
    g = rounder.group
    out = np.empty((E, R, n // bs * ts), dtype=np.uint8)
    lazy = max(LAZY_COLUMNS, bs)
    inv_diag = (1.0 / torch.diagonal(u, dim1=-2, dim2=-1)).unsqueeze(-1).unsqueeze(-1).unbind(1)  # n x (E|1,1,1)
    if g > 1:  # U's g x g diagonal blocks inverted in one call, not one call (and its host work) per group
        block_inv = torch.linalg.inv_ex(diagonal_blocks(u, g))[0]             # (E|1, n/g, g, g)
    for c0 in range(0, n, lazy):
        c1 = min(n, c0 + lazy)
        err = torch.zeros(E, R, c1 - c0, device=dev)
        for b0 in range(c0, c1, bs):
            blocks = _encode_block(targets[..., b0:b0 + bs], qtype, importance[:, b0:b0 + bs])
            rounder.start(blocks)
            for j in range(b0, b0 + bs, g):
                ub_inv = inv_diag[j] if g == 1 else block_inv[:, j // g]  # (E|1, g, g)
                metric = (ub_inv * ub_inv).sum(-1)                          # diag of U⁻¹U⁻ᵀ: (E|1, g)
                t = targets[..., j:j + g]
                e = (t - rounder.round(t, j - b0, metric)) @ ub_inv         # (E, rows, g)
                err[..., j - c0:j - c0 + g] = e
                if j + g < c1:
                    targets[..., j + g:c1] -= e @ u[:, j:j + g, j + g:c1]
            out[:, :, b0 // bs * ts:(b0 + bs) // bs * ts] = rounder.finish(blocks)
        if c1 < n:
            targets[..., c1:] -= err @ u[:, c0:c1, c1:]
    if refine and qtype not in gl.IQ1_TYPES:  # the IQ1 types have no descent passes: the walk alone
        wd, hd = w3.to(dev, torch.float32), _damped(h3.to(dev), damp)
        for _ in range(refine):  # codes, then the sub-block scales and super-scales for those codes
            if qtype in gl.CODE_RANGE:
                out = refine_codes(wd, out, qtype, hd, 1)
            else:  # IQ2 codebook groups: the same descent, one group of 8 at a time
                out = refine_iq2(wd, out, qtype, hd, 1)
            if REFIT_SCALES and qtype in gl.SUB_SCALES:
                out = refine_sub_scales(wd, out, qtype, hd)
            if REFIT_SCALES:
                out = refit_super_scales(wd, out, qtype, hd)
    return out if w.ndim == 3 else out[0]
