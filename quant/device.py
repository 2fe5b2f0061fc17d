"""Device placement, in one place: numerics run on CUDA when present, else on the CPU."""
from __future__ import annotations

import torch


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """`device` if given, else cuda when available, else cpu."""
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
