"""Measured rate–distortion curves of Linears under the EXL3 trellis quantizer (``plan --measure``).

For a weight W (HF orientation, out × in) and its calibration Hessian H (in × in, as ``quant/hessian.py``
accumulates it: Σ x·xᵀ / N), the Hessian-weighted proxy loss of a quantization Ŵ is
``tr((W − Ŵ)·H·(W − Ŵ)ᵀ)`` = the mean squared error of the Linear's output over the calibration tokens.
``measure`` returns it for each bitrate K by quantizing with the real encoder (``quant.trellis``: same
incoherence transform, scale search, LDLQ with H, Viterbi and codebook as the EXL3 pipeline).

Exact mode (``strips=None``) calls the public ``trellis.quantize`` and measures the dequantized weight: every
16×16 tile is encoded. That is the figure on a GPU, but a CPU encodes ~15-25 tiles/s, so the sampled mode
encodes only a few 16-column strips of the *rotated* output dimension. It runs the trellis encoder's own steps
(``regularize``, ``global_scale``, ``block_ldl``, ``ldlq``, ``encode_tiles``) on the chosen strips: after
the 128-point Hadamards the rotated columns are quantized independently (a tile is 16×16, LDLQ feeds errors
back along the input dimension within a column), so a strip gets the error the full encode gives it (with the
scale search run on the sampled tiles). The loss of rotated column c is e_cᵀ·A·e_c·M_cc with A the rotated loss
Hessian and M_cc the mean of svh² over c's 128-column block. The estimate sums the sampled columns with
stratified weights (``strip_sample``: strips holding an outlier of W_r are always encoded, the others sampled)
and drops the cross terms between columns (zero-mean) and the least-squares scale refit the full encoder ends
with (it needs every column; worth ~2%). docs/planning.md §3 and tests/quant/test_trellis_loss.py give the
accuracy against the exact mode.

Numerics only: no file I/O; runs on the weight's device.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import codebooks as cb
from . import encoder as trellis
from .hadamard import BLOCK as HBLOCK, had_both, hadamard_matrix
from .ldlq import block_ldl, damp, ldlq
from .viterbi import encode_tiles

TILE = 16
OUTLIER_PEAK = 1.2  # a strip whose peak |W_r| is this far above the median strip's is measured with certainty


def proxy_loss(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """tr((W − Ŵ)·H·(W − Ŵ)ᵀ) per matrix: (out, in) → scalar, (E, out, in) with (E, in, in) → (E,)."""
    d = (weight.double() - approx.double())
    hd = torch.matmul(d, hessian.to(d.device).double())
    return (hd * d).sum((-2, -1))


def strip_sample(n_strips: int, count: int, seed: int,
                 peak: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
    """Strips to encode and their weights (Σ weight·loss estimates the whole matrix's loss).

    Stratified: strips whose peak |W_r| exceeds ``OUTLIER_PEAK`` × the median strip peak (at most ``count``,
    highest first) are encoded with weight 1: at 5+ bits the loss of such a strip is dominated by the few
    values beyond the codebook's range (measured: one strip of 24 held 3.4x the mean loss at K=6), so sampling
    them at random would swing the estimate by the whole stratum. Then ``count`` of the other strips,
    one at random per equal slice (deterministic for ``seed``), weighted by (others / count)."""
    certain: list[int] = []
    if peak is not None and n_strips > 1:
        thr = OUTLIER_PEAK * float(peak.median())
        certain = [j for j in torch.argsort(peak, descending=True)[:count].tolist() if float(peak[j]) > thr]
    rest = [j for j in range(n_strips) if j not in certain]
    if not rest:
        return certain, [1.0] * len(certain)
    count = max(1, min(int(count), len(rest)))
    gen = torch.Generator().manual_seed(int(seed))
    edges = torch.linspace(0, len(rest), count + 1).round().long().tolist()
    picks = sorted({rest[lo + int(torch.randint(0, max(1, hi - lo), (1,), generator=gen))]
                    for lo, hi in zip(edges, edges[1:])})
    return certain + picks, [1.0] * len(certain) + [len(rest) / len(picks)] * len(picks)


def column_plan(out_f: int, count: int, seed: int, peak: torch.Tensor) -> tuple[list[int], list[float], list[int]]:
    """Which rotated 16-column strips of an (.., out_f) weight to encode: (sampled strips, their weights,
    strips of a partial block encoded whole).

    Full 128-column blocks: ``strip_sample`` over all their strips. A partial last block (out_f % 128 = r real
    columns) is different: W_r's rotated columns there span only r dimensions, so their errors are correlated
    and the per-column sum misses most of the loss (4x for r = 32). When r divides 128 (and 16 divides r) the
    rotated columns repeat exactly with period r (Sylvester order: H₁₂₈ = H₁₂₈/ᵣ ⊗ Hᵣ), so are their errors,
    and the loss is (128/r)² × that of the first r columns: those are sampled with that factor. Any other r
    encodes the whole block and keeps every cross term."""
    spb = HBLOCK // TILE
    nf = (out_f // HBLOCK) * spb
    r = out_f % HBLOCK
    idx: list[int] = []
    wt: list[float] = []
    if nf:
        idx, wt = strip_sample(nf, count, seed, peak[:nf])
    if not r:
        return idx, wt, []
    if HBLOCK % r or r % TILE:
        return idx, wt, list(range(nf, nf + spb))
    nu = r // TILE
    pi, pw = strip_sample(nu, count, seed + 7919, peak[nf:nf + nu])
    f = (HBLOCK / r) ** 2
    return idx + [nf + j for j in pi], wt + [x * f for x in pw], []


@torch.no_grad()
def measure(weight: torch.Tensor, hessian: torch.Tensor | None, rates: Sequence[float], *,
            loss_hessian: torch.Tensor | None = None, strips: int | None = None, scale_tiles: int = 4,
            codebook: str = "mul1", seed: int = 0) -> torch.Tensor:
    """Proxy loss of each matrix at each rate: (len(rates), E) float64 (E = 1 for a 2-D weight).

    weight (out, in) or (E, out, in); hessian the matching (in, in) / (E, in, in) calibration Hessian that the
    encoder's LDLQ uses (None: no LDLQ, as the pipeline does without calibration); loss_hessian the Hessian
    the loss is weighted with (default: ``hessian``; e.g. a routing-weighted one for an expert).
    strips: None = exact (public ``trellis.quantize``, all tiles); an int = encode that many 16-column strips
    of the rotated output dimension per matrix and scale up (module docstring). scale_tiles: tiles the
    sampled mode's global-scale search looks at (the CPU encoder uses 12 of the whole matrix; fewer is faster).
    """
    stacked = weight.dim() == 3
    w = weight if stacked else weight.unsqueeze(0)
    h = None if hessian is None else (hessian if stacked else hessian.unsqueeze(0))
    lh = h if loss_hessian is None else (loss_hessian if stacked else loss_hessian.unsqueeze(0))
    if lh is None:
        lh = torch.eye(w.shape[2], device=w.device).expand(w.shape[0], -1, -1)
    out = torch.zeros(len(rates), w.shape[0], dtype=torch.float64)
    n_strips = -(-w.shape[1] // trellis.PAD) * trellis.PAD // TILE
    if strips is None or strips >= n_strips:
        for i, bits in enumerate(rates):
            qs = trellis.quantize(w, bits, hessian=h, codebook=codebook, seed=seed)
            deq = torch.stack([q.dequantize() for q in qs]).to(w.device)
            out[i] = proxy_loss(w.float(), deq, lh).cpu()
        return out
    return _measure_sampled(w, h, lh, rates, strips, scale_tiles, codebook, seed)


def _measure_sampled(w: torch.Tensor, h: torch.Tensor | None, lh: torch.Tensor, rates: Sequence[float],
                     strips: int, scale_tiles: int, codebook: str, seed: int) -> torch.Tensor:
    """The sampled mode of ``measure`` (E, out, in) weights: the encoder's steps on a subset of rotated strips."""
    codebook = cb.canonical_codebook(codebook)
    w, h, _ = trellis.check_inputs(w, h)
    dev = w.device
    e, out_f, in_f = w.shape
    k, n = trellis.pad_to(in_f), trellis.pad_to(out_f)
    wk = torch.zeros(e, k, n, device=dev)
    wk[:, :in_f, :out_f] = w.transpose(1, 2)
    lk = torch.zeros(e, k, k, device=dev, dtype=torch.float64)
    lk[:, :in_f, :in_f] = lh.to(dev, torch.float64)
    # same sign streams as trellis.quantize(seed=seed), so the rotation is the one the encoder would use
    gen = torch.Generator().manual_seed(int(seed))
    s_in = torch.stack([trellis.random_signs(k, gen) for _ in range(e)]).to(dev)
    s_out = torch.stack([trellis.random_signs(n, gen) for _ in range(e)]).to(dev)
    table = cb.codebook_table(codebook, dev)
    wr, su, sv, zero_col = trellis.regularize(wk, s_in, s_out, cb.CODEBOOK_STD[codebook])
    # M_cc: svh² averaged over the 128-column block of c (zero-padded outputs carry no loss)
    sv2 = torch.where(zero_col, torch.zeros_like(sv), sv).double().square()
    m_blk = sv2.view(e, n // HBLOCK, HBLOCK).mean(2).repeat_interleave(HBLOCK, 1)  # (E, n)
    peaks = wr.abs().view(e, k, n // TILE, TILE).amax((1, 3))  # (E, strips)
    hmat = hadamard_matrix(dev, torch.float64)
    subs, weights, n_diag, m_exact, lmats, amats = [], [], [], [], [], []
    for i in range(e):
        idx, wt, exact = column_plan(out_f, strips, seed + i, peaks[i])
        cols = (torch.tensor(idx + exact, dtype=torch.long).unsqueeze(1) * TILE + torch.arange(TILE)).reshape(-1)
        cols = cols.to(dev)
        subs.append(wr[i][:, cols])  # (k, s·16): the sampled rotated columns
        n_diag.append(len(idx) * TILE)
        weights.append(m_blk[i, cols[:len(idx) * TILE]]
                       * torch.tensor(wt, dtype=torch.float64, device=dev).repeat_interleave(TILE))
        # a partial output block encoded whole: its loss with every cross term, M = Hₙ·diag(svh²)·Hₙ
        m_exact.append(hmat @ torch.diag(sv2[i, cols[len(idx) * TILE:]]) @ hmat if exact else None)
        # LDLQ factor of the rotated Hessian and the loss Hessian in the rotated basis; the global scale g
        # multiplies W_r and divides su, which scales both Hessians by 1/g² and leaves the LDL factor unchanged
        if h is not None:
            hk = torch.zeros(k, k, device=dev, dtype=torch.float64)
            hk[:in_f, :in_f] = h[i]
            hk = damp(hk, trellis.REL_DAMP)
            lmats.append(block_ldl(had_both((su[i].double().unsqueeze(1) * hk * su[i].double()).float()),
                                   trellis.REL_DAMP))
        amats.append(had_both(su[i].double().unsqueeze(1) * lk[i] * su[i].double()))
    scale_sample = trellis.sample_tiles(torch.cat([cb.tiles_from_matrix(x).reshape(-1, TILE * TILE) for x in subs]),
                                         max(1, scale_tiles))
    out = torch.zeros(len(rates), e, dtype=torch.float64)
    for r, bits in enumerate(rates):
        bits = cb.check_bits(bits, codebook)
        drift = trellis.LDLQ_DRIFT.get(bits, 1.0) if h is not None else 1.0
        g = trellis.global_scale(scale_sample, table, bits, drift, codebook)  # one g per stack, as the encoder

        def quant_strip(target: torch.Tensor, b: int, _bits=bits) -> torch.Tensor:
            st = encode_tiles(cb.tiles_from_matrix(target).reshape(-1, TILE * TILE), table, _bits)
            return cb.matrix_from_tiles(table[st].view(target.shape[0], 1, -1, TILE * TILE))

        for i in range(e):
            sub = (subs[i] * g).unsqueeze(0)
            if h is None:
                tiles = cb.tiles_from_matrix(sub)
                q = cb.matrix_from_tiles(table[encode_tiles(tiles.reshape(-1, TILE * TILE), table, bits)]
                                         .view(tiles.shape))
            else:
                q = ldlq(sub, lmats[i].unsqueeze(0), quant_strip)
            err = (sub - q)[0].double() / g  # rotated-basis error of the sampled columns, in su's unscaled basis
            d = n_diag[i]
            per_col = ((amats[i] @ err[:, :d]) * err[:, :d]).sum(0)  # e_cᵀ A e_c
            total = float((per_col * weights[i]).sum())
            if m_exact[i] is not None:
                eb = err[:, d:]
                total += float(((eb.T @ amats[i] @ eb) * m_exact[i]).sum())
            out[r, i] = total
    return out
