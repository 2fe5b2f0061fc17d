"""QTIP-style trellis quantizer producing EXL3 Linear tensors (facts in reference exl3-format.md §1.4-3.6).

Pipeline per Linear (W = HF weightᵀ, (k, n) = (in, out), zero-padded to multiples of 128):
random signs + per-channel RMS scales on both sides, blockwise 128-point Hadamards (incoherence), a global scale
picked on a few sample tiles, tail-biting Viterbi per 16×16 tile (LDLQ error feedback when a Hessian is given),
then a least-squares refit of the channel scales. Everything runs on the weight's device, batched over tiles and
over stacked experts. The stages (``check_inputs``, ``pad_to``, ``regularize``, ``sample_tiles``,
``global_scale``) are public for quant/trellis/loss.py, which runs them on sampled strips.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ...errors import FormatError, InputError
from ...formats.exl3_layout import PAD
from . import codebooks as cb
from .hadamard import had_both, had_cols, had_rows, random_signs
from .ldlq import block_ldl, damp, ldlq
from .viterbi import encode_tiles, viterbi_free

REL_DAMP = 0.025
# LDLQ feedback widens the quantizer's input a little at low rates (reference §3.5); applied in the scale search.
LDLQ_DRIFT = {1.0: 1.08, 1.5: 1.035, 2.0: 1.018, 2.5: 1.009, 3.0: 1.004}
# Starting points of the global scale search (g for W_r ← g·W_r), the values the wide GPU search picked on N(0,1)
# 256×1024 (bench/speed/trellis.py on a GPU); the CPU search refines them ±7% on a few tiles.
SCALE_PRIOR = {
    "mul1": {1.0: 1.10, 1.5: 1.016, 2.0: 0.98, 2.5: 0.95, 3.0: 0.936, 3.5: 0.912, 4.0: 0.897, 5.0: 0.868,
             6.0: 0.832, 7.0: 0.80, 8.0: 0.777},
    "3inst": {1.0: 1.125, 2.0: 0.98, 3.0: 0.935, 4.0: 0.895, 5.0: 0.865, 6.0: 0.807, 7.0: 0.752, 8.0: 0.728},
}
SCALE_PRIOR["mcg"] = SCALE_PRIOR["3inst"]


@dataclass
class TrellisStats:
    """What one quantize call decided and, when profiled, where its time went."""
    scale: float = 0.0  # the global scale g (W_r ← g·W_r)
    seconds: dict[str, float] = field(default_factory=dict)  # per phase, filled when profile=True
    profile: bool = False


@contextmanager
def _phase(name: str, device: torch.device, stats: TrellisStats):
    """Time a phase into stats.seconds (synchronising the device around it) when stats.profile is set."""
    if not stats.profile:
        yield
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats.seconds[name] = stats.seconds.get(name, 0.0) + time.perf_counter() - t0


@dataclass
class QuantizedLinear:
    """One EXL3-quantized Linear: the stored tensors plus the HF shape (out, in)."""
    trellis: torch.Tensor  # int16 (k/16, n/16, 16K)
    suh: torch.Tensor      # fp16 (k,)
    svh: torch.Tensor      # fp16 (n,)
    codebook: str
    shape: tuple[int, int]

    @property
    def bits(self) -> float:
        """Bitrate K = trellis.shape[-1] / 16 (int-valued float for integer rates)."""
        return self.trellis.shape[-1] / 16

    def rotated(self) -> torch.Tensor:
        """Ŵ (k, n): the decoded codebook values in the rotated basis (fp16-exact, float32)."""
        states = cb.unpack_states(self.trellis, self.bits)
        return cb.matrix_from_tiles(cb.decode_states(states, self.codebook))

    def dequantize(self) -> torch.Tensor:
        """HF-layout float32 weight (out, in): W = diag(suh)·Hₖ·Ŵ·Hₙ·diag(svh), transposed and unpadded."""
        w = had_both(self.rotated())
        w = w * self.suh.float().unsqueeze(1) * self.svh.float().unsqueeze(0)
        out_f, in_f = self.shape
        return w[:in_f, :out_f].t().contiguous()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The EXL3 per-Linear tensors (without the key prefix): trellis, suh, svh and the codebook marker."""
        t = {"trellis": self.trellis, "suh": self.suh, "svh": self.svh}
        if self.codebook in cb.MARKER_VALUES:
            t[self.codebook] = torch.tensor(cb.MARKER_VALUES[self.codebook], dtype=torch.int32)
        return t


def from_tensors(tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> QuantizedLinear:
    """Rebuild a QuantizedLinear from stored tensors (keys without prefix) and the HF shape (out, in)."""
    for key in ("trellis", "suh", "svh"):
        if key not in tensors:
            raise FormatError(f"EXL3 Linear is missing its '{key}' tensor (have {sorted(tensors)})")
    markers = [m for m in ("mul1", "mcg") if m in tensors]
    if len(markers) > 1:
        raise FormatError("EXL3 Linear carries both 'mul1' and 'mcg' codebook markers")
    codebook = markers[0] if markers else "3inst"
    if markers:
        val = tensors[codebook]
        if val.numel() != 1 or int(val.reshape(-1)[0].to(torch.int64)) != cb.MARKER_VALUES[codebook]:
            raise FormatError(f"EXL3 '{codebook}' marker holds {val.tolist()}, expected {cb.MARKER_VALUES[codebook]}")
    trellis, suh, svh = tensors["trellis"], tensors["suh"], tensors["svh"]
    if trellis.dim() != 3 or trellis.dtype != torch.int16:
        raise FormatError(f"EXL3 trellis must be 3-D int16, got {tuple(trellis.shape)} {trellis.dtype}")
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    bits = trellis.shape[2] / 16
    try:
        cb.check_bits(bits, codebook)
    except InputError as exc:
        raise FormatError(f"EXL3 trellis last dim {trellis.shape[2]}: {exc}") from None
    if tuple(suh.shape) != (k,) or tuple(svh.shape) != (n,):
        raise FormatError(f"EXL3 suh/svh shapes {tuple(suh.shape)}/{tuple(svh.shape)} do not match trellis k={k}, n={n}")
    out_f, in_f = (int(s) for s in shape)
    if not (0 < in_f <= k and 0 < out_f <= n and k - in_f < PAD and n - out_f < PAD):
        raise FormatError(f"HF shape {(out_f, in_f)} does not fit trellis padded (in, out) = ({k}, {n})")
    return QuantizedLinear(trellis.to(torch.int16), suh.to(torch.float16), svh.to(torch.float16), codebook,
                           (out_f, in_f))


# ---------------------------------------------------------------------------------------------------------------
# Encoder

def pad_to(n: int) -> int:
    """n rounded up to the EXL3 padding (multiples of 128)."""
    return -(-n // PAD) * PAD


def check_inputs(weight: torch.Tensor, hessian: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """Validate a (out, in) / (E, out, in) weight and its Hessian: returns (E, out, in) float32, the float64
    (E, in, in) Hessian on the weight's device (None when absent or degenerate) and whether the input was stacked."""
    if not isinstance(weight, torch.Tensor) or weight.dim() not in (2, 3):
        raise InputError(f"trellis.quantize expects a (out, in) or (E, out, in) weight tensor, got "
                         f"{getattr(weight, 'shape', type(weight))}")
    stacked = weight.dim() == 3
    w = weight if stacked else weight.unsqueeze(0)
    if w.shape[1] == 0 or w.shape[2] == 0 or w.shape[0] == 0:
        raise InputError(f"trellis.quantize: empty weight of shape {tuple(weight.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise InputError(f"trellis.quantize: weight of shape {tuple(weight.shape)} has non-finite values")
    h = None
    if hessian is not None:
        h = hessian if stacked else hessian.unsqueeze(0)
        in_f = w.shape[2]
        if tuple(h.shape) != (w.shape[0], in_f, in_f):
            raise InputError(f"trellis.quantize: hessian shape {tuple(hessian.shape)} does not match weight "
                             f"{tuple(weight.shape)} (need (in, in) per weight)")
        h = h.to(device=w.device, dtype=torch.float64)
        if not bool(torch.isfinite(h).all()):
            raise InputError("trellis.quantize: hessian has non-finite values")
        # an empty/degenerate capture falls back to the Hessian-free path (as the reference does)
        if float(torch.diagonal(h, dim1=-2, dim2=-1).mean()) < 1e-20:
            h = None
    return w.float(), h, stacked


def regularize(w: torch.Tensor, s_in: torch.Tensor, s_out: torch.Tensor, cb_std: float):
    """(E, k, n) → rotated W_r with row RMS ≈ cb_std, plus su (E, k) and sv (E, n) with W = su·Hₖ·W_r·Hₙ·sv."""
    sigma = w.square().mean(1).sqrt()  # column RMS (E, n)
    zero_col = sigma <= 1e-30
    mean_sigma = sigma.mean(1, keepdim=True).clamp_min(1e-30)
    sigma = torch.where(zero_col, torch.full_like(sigma, 0.1), sigma / mean_sigma)
    sv = s_out * sigma
    wr = had_cols(w / sv.unsqueeze(1))
    rho = wr.square().mean(2).sqrt()  # row RMS (E, k)
    rho = torch.where(rho <= 1e-30, torch.full_like(rho, 0.1), rho)
    su = s_in * rho / cb_std
    wr = had_rows(wr / su.unsqueeze(2))
    return wr, su, sv, zero_col


def sample_tiles(tiles: torch.Tensor, count: int) -> torch.Tensor:
    """Deterministic, evenly spread sample of tiles from (E, ..., 256) (unbiased for the total MSE)."""
    flat = tiles.reshape(-1, 256)
    n = flat.shape[0]
    if n <= count:
        return flat
    return flat[torch.linspace(0, n - 1, count, device=flat.device).round().long()]


def global_scale(tiles: torch.Tensor, table: torch.Tensor, bits: float, drift: float, codebook: str) -> float:
    """Pick g for W_r ← g·W_r: free-start Viterbi MSE of sample tiles on a grid around the prior, then a parabola
    through the best grid point and its neighbours. Many tiles and a wide grid on a GPU, a few on the CPU."""
    gpu = tiles.is_cuda
    sample = sample_tiles(tiles, 256 if gpu else 12) * drift
    g0 = SCALE_PRIOR[codebook].get(bits, 0.9)
    step = 0.05 if gpu else 0.07
    factors = [1 + step * i for i in (range(-4, 5) if gpu else range(-1, 2))]
    gs = [g0 * f for f in factors]
    batch = torch.cat([sample * g for g in gs], 0)
    mse = viterbi_free(batch, table, bits).view(len(gs), -1).mean(1).tolist()
    err = [mse[i] / gs[i] ** 2 for i in range(len(gs))]  # error in the unscaled basis
    i = min(range(len(gs)), key=lambda j: err[j])
    i = min(max(i, 1), len(gs) - 2)
    a = err[i - 1] - 2 * err[i] + err[i + 1]
    if a <= 0:
        return gs[min(range(len(gs)), key=lambda j: err[j])]
    off = max(-1.0, min(1.0, 0.5 * (err[i - 1] - err[i + 1]) / a))
    return g0 * (factors[i] + step * off)


def _refit(w: torch.Tensor, q: torch.Tensor, su: torch.Tensor, sv: torch.Tensor, h: torch.Tensor | None,
           rounds: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares refit of channel scales in the original basis (trellis untouched): columns then rows."""
    hh = h.float() if h is not None else None
    hw = torch.bmm(hh, w) if hh is not None else w  # W does not change between the rounds
    for _ in range(rounds):
        hq = torch.bmm(hh, q) if hh is not None else q
        c = (hq * w).sum(1) / (hq * q).sum(1)  # (E, n)
        c = torch.where(torch.isfinite(c) & (c > 0), c, torch.ones_like(c))
        sv, q = sv * c, q * c.unsqueeze(1)
        rhs = (q * hw).sum(2)  # (E, k)
        if hh is not None:
            gram = torch.bmm(q, q.transpose(1, 2)) * hh
            gram = gram + 1e-6 * torch.diagonal(gram, dim1=1, dim2=2).mean(1).clamp_min(1e-30)[:, None, None] * \
                torch.eye(gram.shape[1], device=gram.device)
            r = spd_solve(gram.double(), rhs.double().unsqueeze(2)).squeeze(2).float()
        else:
            r = rhs / q.square().sum(2)
        r = torch.where(torch.isfinite(r) & (r > 0), r, torch.ones_like(r))
        su, q = su * r, q * r.unsqueeze(2)
    return su, sv


def spd_solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Solve a·x = b for a batch of symmetric positive definite `a` (E, k, k) by Cholesky (half the work of LU);
    a matrix whose factorisation fails (not numerically definite) is solved by LU instead."""
    chol, info = torch.linalg.cholesky_ex(a)
    x = torch.cholesky_solve(b, chol)
    bad = info != 0
    if bool(bad.any()):
        x[bad] = torch.linalg.solve(a[bad], b[bad])
    return x


def quantize(weight: torch.Tensor, bits: float, hessian: torch.Tensor | None = None, codebook: str = "mul1",
             seed: int = 0) -> QuantizedLinear | list[QuantizedLinear]:
    """Quantize an HF (out, in) weight — or a stacked (E, out, in) batch with (E, in, in) Hessians — to EXL3.

    hessian: Σ x·xᵀ over calibration tokens (in, in); enables LDLQ and a Hessian-weighted scale refit.
    Returns a QuantizedLinear, or a list of E of them for stacked input. Deterministic for a given seed/device.
    """
    return quantize_with_stats(weight, bits, hessian, codebook, seed)[0]


def quantize_with_stats(weight: torch.Tensor, bits: float, hessian: torch.Tensor | None = None,
                        codebook: str = "mul1", seed: int = 0, profile: bool = False
                        ) -> tuple[QuantizedLinear | list[QuantizedLinear], TrellisStats]:
    """``quantize`` plus its TrellisStats (the global scale; per-phase seconds when ``profile``, which
    synchronises the device between phases)."""
    codebook = cb.canonical_codebook(codebook)
    bits = cb.check_bits(bits, codebook)
    stats = TrellisStats(profile=profile)
    w, h, stacked = check_inputs(weight, hessian)
    dev = w.device
    e, out_f, in_f = w.shape
    k, n = pad_to(in_f), pad_to(out_f)
    wk = torch.zeros(e, k, n, device=dev)
    wk[:, :in_f, :out_f] = w.transpose(1, 2)
    hk = None
    if h is not None:
        hk = torch.zeros(e, k, k, device=dev, dtype=torch.float64)
        hk[:, :in_f, :in_f] = h
        hk = damp(hk, REL_DAMP)

    with _phase("regularize", dev, stats):
        gen = torch.Generator().manual_seed(int(seed))
        s_in = torch.stack([random_signs(k, gen) for _ in range(e)]).to(dev)
        s_out = torch.stack([random_signs(n, gen) for _ in range(e)]).to(dev)
        table = cb.codebook_table(codebook, dev)
        wr, su, sv, zero_col = regularize(wk, s_in, s_out, cb.CODEBOOK_STD[codebook])
        tiles = cb.tiles_from_matrix(wr)  # (E, k/16, n/16, 256)
    with _phase("scale_search", dev, stats):
        drift = LDLQ_DRIFT.get(bits, 1.0) if hk is not None else 1.0
        g = global_scale(tiles, table, bits, drift, codebook)
        stats.scale = g
        wr, tiles, su = wr * g, tiles * g, su / g

    tk, tn = k // 16, n // 16
    if hk is None:
        with _phase("viterbi", dev, stats):
            states = encode_tiles(tiles.reshape(-1, 256), table, bits).view(e, tk, tn, 256)
    else:
        with _phase("ldl", dev, stats):
            # LDLQ on the Hessian of W_r: Hₖ·diag(su)·H·diag(su)·Hₖ (the rotation and input scales are part of W)
            hr = had_both((su.double().unsqueeze(2) * hk * su.double().unsqueeze(1)).float())
            lmat = block_ldl(hr, REL_DAMP)
        states = torch.zeros(e, tk, tn, 256, dtype=torch.int64, device=dev)

        def quant_strip(target: torch.Tensor, b: int) -> torch.Tensor:
            with _phase("viterbi", dev, stats):
                st = encode_tiles(cb.tiles_from_matrix(target).reshape(-1, 256), table, bits).view(e, 1, tn, 256)
            states[:, b:b + 1] = st
            return cb.matrix_from_tiles(table[st])

        with _phase("ldlq_total", dev, stats):
            ldlq(wr, lmat, quant_strip)

    with _phase("refit", dev, stats):
        qr = cb.matrix_from_tiles(table[states])
        q = had_both(qr) * su.unsqueeze(2) * sv.unsqueeze(1)
        su, sv = _refit(wk, q, su, sv, hk)
        sv = torch.where(zero_col, torch.zeros_like(sv), sv)
    with _phase("pack", dev, stats):
        trellis = cb.pack_states(states, bits)
    out = []
    for i in range(e):
        out.append(QuantizedLinear(trellis[i].contiguous(), _to_fp16(su[i]), _to_fp16(sv[i]), codebook,
                                   (out_f, in_f)))
    return (out if stacked else out[0]), stats


def _to_fp16(v: torch.Tensor) -> torch.Tensor:
    """fp16 with magnitudes kept inside the normal-ish range (huge values clamp, tiny ones stay subnormal)."""
    return v.clamp(-65504.0, 65504.0).to(torch.float16)
