"""NaN / Inf in a tensor, found in one pass: every tensor mixq reads from a checkpoint goes through `check_finite`,
so a corrupt value never reaches an output.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mixq.errors import InputError

# fp8 bit patterns that are NaN/Inf: (mask, value) on the raw byte (e4m3fn has NaN only; e5m2 an all-ones exponent)
_FP8_SPECIAL = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C),
                torch.float8_e4m3fnuz: (0xFF, 0x80), torch.float8_e5m2fnuz: (0xFF, 0x80)}


def has_non_finite(flat: torch.Tensor) -> bool:
    """One pass: fused min/max for wider floats (NaN propagates through both, +-Inf shows in one),
    a bit test on the raw byte for fp8 (whose conversion to float is slow on a CPU)."""
    if flat.dtype in _FP8_SPECIAL:
        mask, value = _FP8_SPECIAL[flat.dtype]
        u = flat.view(torch.uint8)
        if mask != value:
            return bool((u == value).any())
        # the special pattern is the largest masked byte: one AND + max (numpy's uint8 loops are SIMD on CPU)
        top = np.bitwise_and(u.numpy(), mask).max() if u.device.type == "cpu" else (u & mask).max()
        return int(top) == value
    lo, hi = torch.aminmax(flat)
    return not bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_finite(t: torch.Tensor, name: str, where: str | Path | None) -> None:
    """InputError naming `where` (the file) and `name` when the float tensor `t` holds NaN or +-Inf.
    The counts and the first position are computed only for a bad tensor."""
    if t.numel() == 0 or not t.is_floating_point():
        return
    flat = t.reshape(-1)
    if not has_non_finite(flat):
        return
    bad = ~torch.isfinite(flat.float())
    first = int(bad.nonzero()[0, 0])
    pos = [int(p) for p in torch.unravel_index(torch.tensor(first), tuple(t.shape))] if t.dim() > 1 else [first]
    n_nan, n_bad = int(torch.isnan(flat.float()).sum()), int(bad.sum())
    prefix = f"{where}: " if where is not None else ""
    raise InputError(f"{prefix}tensor {name!r} holds non-finite values ({n_nan} NaN, {n_bad - n_nan} Inf of "
                     f"{t.numel()}; first at {pos}): the checkpoint is corrupt")
