"""Torch's CPU thread count in tests: a call run at a given count, the caller's count given back."""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def at_threads(n: int, fn: Callable[[], T]) -> T:
    """fn() with torch at n intra-op threads, the count restored after."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)
