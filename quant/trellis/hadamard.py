"""Blockwise 128-point Walsh–Hadamard transforms and random sign vectors (reference §2.1, §3.3).

H128 is the natural-order Sylvester matrix scaled by 1/√128: symmetric, orthonormal, self-inverse.
"""
from __future__ import annotations

from functools import lru_cache

import torch

BLOCK = 128


@lru_cache(maxsize=None)
def _h128(device: str, dtype: torch.dtype) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / BLOCK ** 0.5).to(device=device, dtype=dtype)


def hadamard_matrix(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """H128/√128 (Sylvester order)."""
    return _h128(str(torch.device(device)), dtype)


def had_cols(w: torch.Tensor) -> torch.Tensor:
    """W · Hₙ: mix every consecutive 128-column group of (..., k, n)."""
    h = hadamard_matrix(w.device, w.dtype)
    *lead, k, n = w.shape
    return (w.reshape(*lead, k, n // BLOCK, BLOCK) @ h).reshape(*lead, k, n)


def had_rows(w: torch.Tensor) -> torch.Tensor:
    """Hₖ · W: mix every consecutive 128-row group of (..., k, n)."""
    return had_cols(w.transpose(-1, -2)).transpose(-1, -2)


def had_both(w: torch.Tensor) -> torch.Tensor:
    """Hₖ · W · Hₙ."""
    return had_rows(had_cols(w))


def random_signs(n: int, generator: torch.Generator) -> torch.Tensor:
    """±1 float32 vector of length n from a CPU generator (device-independent stream)."""
    return torch.randint(0, 2, (n,), generator=generator).float().mul_(2).sub_(1)
