"""Measured rate–distortion curves of Linears under the EXL3 trellis quantizer (issue 4, ``--measure``).

For a weight W (HF orientation, out × in) and its calibration Hessian H (in × in, as ``quant/hessian.py``
accumulates it: Σ x·xᵀ / N), the Hessian-weighted proxy loss of a quantization Ŵ is
``tr((W − Ŵ)·H·(W − Ŵ)ᵀ)`` = the mean squared error of the Linear's output over the calibration tokens.
``measure`` returns it for each bitrate K by quantizing with the real encoder (``quant.trellis``: same
incoherence transform, scale search, LDLQ with H, Viterbi and codebook as the EXL3 pipeline).

Exact mode (``strips=None``) calls the public ``trellis.quantize`` and measures the dequantized weight: every
16×16 tile is encoded. That is the figure on a GPU, but a CPU encodes ~15 tiles/s, so the sampled mode
encodes only a few 16-column strips of the *rotated* output dimension. It runs the trellis encoder's own steps
(``_regularize``, ``_global_scale``, ``block_ldl``, ``ldlq``, ``encode_tiles``) up to the choice of the
strips: after the 128-point Hadamards the rotated columns are quantized independently (a tile is 16×16, LDLQ
feeds errors back along the input dimension within a column), so a strip's error is exactly what the full
encode gives it. The loss of rotated column c is e_cᵀ·A·e_c·M_cc with A the rotated Hessian and M_cc the
mean of svh² over c's 128-column block; summing over the sampled columns and scaling by n / sampled drops the
cross terms between columns (zero-mean) and the least-squares scale refit the full encoder ends with (which
needs every column). tests/quant/test_sensitivity.py measures both effects against the exact mode.

Numerics only: no file I/O; runs on the weight's device.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import codebooks as cb
from . import trellis
from .hadamard import BLOCK as HBLOCK, had_both
from .ldlq import block_ldl, damp, ldlq
from .viterbi import encode_tiles

TILE = 16


def proxy_loss(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """tr((W − Ŵ)·H·(W − Ŵ)ᵀ) per matrix: (out, in) → scalar, (E, out, in) with (E, in, in) → (E,)."""
    d = (weight.double() - approx.double())
    hd = torch.matmul(d, hessian.to(d.device).double())
    return (hd * d).sum((-2, -1))


def strip_sample(n_strips: int, count: int, seed: int) -> torch.Tensor:
    """``count`` of the ``n_strips`` 16-column strips, deterministic for ``seed``, spread over the range
    (one random strip per equal slice, so every 128-column Hadamard block is hit as evenly as possible)."""
    count = max(1, min(int(count), n_strips))
    gen = torch.Generator().manual_seed(int(seed))
    edges = torch.linspace(0, n_strips, count + 1).round().long().tolist()
    picks = [lo + int(torch.randint(0, max(1, hi - lo), (1,), generator=gen)) for lo, hi in zip(edges, edges[1:])]
    return torch.tensor(sorted(set(picks)), dtype=torch.long)


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
    w, h, _ = trellis._check_inputs(w, h)
    dev = w.device
    e, out_f, in_f = w.shape
    k, n = trellis._pad_to(in_f), trellis._pad_to(out_f)
    wk = torch.zeros(e, k, n, device=dev)
    wk[:, :in_f, :out_f] = w.transpose(1, 2)
    hk = None
    if h is not None:
        hk = torch.zeros(e, k, k, device=dev, dtype=torch.float64)
        hk[:, :in_f, :in_f] = h
        hk = damp(hk, trellis.REL_DAMP)
    lk = torch.zeros(e, k, k, device=dev, dtype=torch.float64)
    lk[:, :in_f, :in_f] = lh.to(dev, torch.float64)
    # same sign streams as trellis.quantize(seed=seed), so the rotation is the one the encoder would use
    gen = torch.Generator().manual_seed(int(seed))
    s_in = torch.stack([trellis.random_signs(k, gen) for _ in range(e)]).to(dev)
    s_out = torch.stack([trellis.random_signs(n, gen) for _ in range(e)]).to(dev)
    table = cb.codebook_table(codebook, dev)
    wr0, su0, sv, zero_col = trellis._regularize(wk, s_in, s_out, cb.CODEBOOK_STD[codebook])
    cols_idx = strip_sample(n // TILE, strips, seed)
    cols = (cols_idx.unsqueeze(1) * TILE + torch.arange(TILE)).reshape(-1).to(dev)
    sub0 = wr0[:, :, cols]  # (E, k, s·16): the sampled rotated columns
    # M_cc: svh² averaged over the 128-column block of c (zero-padded outputs carry no loss)
    sv2 = torch.where(zero_col, torch.zeros_like(sv), sv).double().square()
    m_blk = sv2.view(e, n // HBLOCK, HBLOCK).mean(2).repeat_interleave(HBLOCK, 1)[:, cols]  # (E, s·16)
    scale_sample = trellis._sample_tiles(cb.tiles_from_matrix(sub0), max(1, scale_tiles))
    out = torch.zeros(len(rates), e, dtype=torch.float64)
    for i, bits in enumerate(rates):
        bits = cb.check_bits(bits, codebook)
        drift = trellis.LDLQ_DRIFT.get(bits, 1.0) if hk is not None else 1.0
        g = trellis._global_scale(scale_sample, table, bits, drift, codebook)
        su = su0 / g
        sub = sub0 * g
        if hk is None:
            q = cb.matrix_from_tiles(table[encode_tiles(cb.tiles_from_matrix(sub).reshape(-1, TILE * TILE), table,
                                                        bits).view(e, k // TILE, -1, TILE * TILE)])
        else:
            hr = had_both((su.double().unsqueeze(2) * hk * su.double().unsqueeze(1)).float())
            lmat = block_ldl(hr, trellis.REL_DAMP)

            def quant_strip(target: torch.Tensor, b: int, _bits=bits) -> torch.Tensor:
                st = encode_tiles(cb.tiles_from_matrix(target).reshape(-1, TILE * TILE), table, _bits)
                return cb.matrix_from_tiles(table[st].view(e, 1, -1, TILE * TILE))

            q = ldlq(sub, lmat, quant_strip)
        err = (sub - q).double()  # rotated-basis error of the sampled columns, (E, k, s·16)
        a = had_both((su.double().unsqueeze(2) * lk * su.double().unsqueeze(1)))  # loss Hessian, rotated basis
        per_col = (torch.bmm(a, err) * err).sum(1)  # e_cᵀ A e_c
        out[i] = ((per_col * m_blk).sum(1) * (n / cols.numel())).cpu()
    return out
