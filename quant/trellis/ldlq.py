"""Block LDL of a damped Hessian and LDLQ error feedback over 16-row strips (reference §3.2, §3.6).

W is (k, n) = (in, out); the proxy loss is tr(Eᵀ H E) with E = W − Q and H (k, k). Writing
H = (I + L) D (I + L)ᵀ with L strictly block-lower (16×16 blocks), the loss is Σ_B ‖D_B^½ (t_B − Q_B)‖² where
t_B = W_B + Σ_{B' > B} L[B', B]ᵀ (W_{B'} − Q_{B'}); strips are therefore quantized from the last to the first.
"""
from __future__ import annotations

from typing import Callable

import torch

BLOCK = 16


def damp(h: torch.Tensor, rel: float) -> torch.Tensor:
    """H + rel·mean(diag H)·I (batched)."""
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    lam = rel * diag.mean(-1).clamp_min(1e-20)
    return h + lam[..., None, None] * torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)


def block_ldl(h: torch.Tensor, rel_damp: float = 0.025, retries: int = 10) -> torch.Tensor:
    """Strictly block-lower L with H_damped = (I+L)·D·(I+L)ᵀ for (..., k, k) H; k a multiple of 16.

    Damping starts at ``rel_damp``·mean(diag) and grows until every Cholesky succeeds.
    """
    k = h.shape[-1]
    h = h.double()
    for attempt in range(retries + 1):
        chol, info = torch.linalg.cholesky_ex(damp(h, rel_damp * (1 + 2 * attempt)))
        if not bool((info != 0).any()):
            break
    else:
        raise ValueError("Hessian is not positive definite even after damping")
    nb = k // BLOCK
    blocks = chol.reshape(*chol.shape[:-2], nb, BLOCK, nb, BLOCK)
    diag_blocks = torch.diagonal(blocks, dim1=-4, dim2=-2).permute(*range(chol.dim() - 2), -1, -3, -2)  # (..., nb, 16, 16)
    inv = torch.linalg.solve_triangular(diag_blocks, torch.eye(BLOCK, dtype=h.dtype, device=h.device).expand_as(diag_blocks),
                                        upper=False)
    # L + I = C · blockdiag(C_bb)^-1  (block column b scaled by inv_b on the right)
    lfull = torch.einsum("...aibj,...bjk->...aibk", blocks, inv).reshape(chol.shape)
    mask = torch.block_diag(*[torch.ones(BLOCK, BLOCK)] * nb).to(device=h.device, dtype=torch.bool)
    return lfull.masked_fill(mask, 0.0).float()


def ldlq(wr: torch.Tensor, lmat: torch.Tensor, quant_strip: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """Quantize (E, k, n) rotated weights strip by strip with error feedback; returns the (E, k, n) quantized values.

    quant_strip(targets (E, 16, n), strip_index) -> quantized values (E, 16, n) (it records its own states).
    """
    e, k, n = wr.shape
    q = torch.zeros_like(wr)
    err = torch.zeros_like(wr)
    for b in range(k // BLOCK - 1, -1, -1):
        lo, hi = b * BLOCK, (b + 1) * BLOCK
        target = wr[:, lo:hi]
        if hi < k:
            target = target + torch.bmm(lmat[:, hi:, lo:hi].transpose(1, 2), err[:, hi:])
        q[:, lo:hi] = quant_strip(target, b)
        err[:, lo:hi] = wr[:, lo:hi] - q[:, lo:hi]
    return q
