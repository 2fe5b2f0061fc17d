"""Input statistics of a Linear: the Hessian proxy Σ x·xᵀ (EXL3 / LDLQ) and the diagonal Σ x² (GGUF imatrix).

Numerics only, no file I/O. One accumulator may be shared by every Linear that reads the same input
(q/k/v of an attention block, gate/up of all experts of a layer), so each input is accumulated once.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch

_PIN = threading.Lock()  # one pinned section at a time, so each restores the count it found


@contextmanager
def one_cpu_thread(device: torch.device) -> Iterator[None]:
    """Torch at one intra-op thread inside, on the CPU (elsewhere a no-op), restored after.

    For a product whose output is small next to its inner dimension (xᵀx of a narrow input over many tokens),
    the CPU BLAS splits the inner sum over its threads, so the rounding of the result follows the thread count;
    one thread sums in the one order that any run reproduces."""
    if device.type != "cpu" or torch.get_num_threads() == 1:
        yield
        return
    with _PIN:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


class HessianAccumulator:
    """Accumulates Σ xᵀx (optional) and Σ x² over token rows, with the token count.

    `full=False` keeps only the diagonal (imatrix), which needs O(dim) memory instead of O(dim²).
    Rows holding any non-finite value are dropped (they would poison the sum), as the reference encoder does.
    """

    def __init__(self, dim: int, *, full: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.dim = int(dim)
        self.full = full
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype
        self.xtx: torch.Tensor | None = (
            torch.zeros(self.dim, self.dim, dtype=dtype, device=self.device) if full else None
        )
        self.sum_sq = torch.zeros(self.dim, dtype=torch.float64, device=self.device)
        self.count = 0
        self.dropped = 0

    def add(self, x: torch.Tensor) -> None:
        """Add the rows of `x` (any leading shape, last dim = `dim`)."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"HessianAccumulator: input width {x.shape[-1]} != {self.dim}")
        x = x.detach().reshape(-1, self.dim).to(device=self.device, dtype=self.dtype)
        finite = torch.isfinite(x).all(dim=1)
        if not bool(finite.all()):
            self.dropped += int((~finite).sum())
            x = x[finite]
        if x.shape[0] == 0:
            return
        if self.xtx is not None:
            with one_cpu_thread(self.device):  # the same sums at any thread count
                self.xtx.addmm_(x.T, x)
        self.sum_sq += x.double().square().sum(dim=0)
        self.count += x.shape[0]

    def move(self, device: torch.device | str) -> None:
        """Keep the sums on `device` from now on (the same values: a copy, no arithmetic)."""
        device = torch.device(device)
        if device == self.device:
            return
        if self.xtx is not None:
            self.xtx = self.xtx.to(device)
        self.sum_sq = self.sum_sq.to(device)
        self.device = device

    def merge(self, other: "HessianAccumulator") -> None:
        """Add another accumulator's sums (e.g. from another device or batch split)."""
        if other.dim != self.dim:
            raise ValueError("HessianAccumulator.merge: width mismatch")
        if self.xtx is not None:
            if other.xtx is None:
                raise ValueError("HessianAccumulator.merge: cannot merge a diagonal-only accumulator into a full one")
            self.xtx += other.xtx.to(self.xtx)
        self.sum_sq += other.sum_sq.to(self.sum_sq)
        self.count += other.count
        self.dropped += other.dropped

    def hessian(self) -> torch.Tensor | None:
        """Mean Σ xᵀx / count in float32, or None when nothing was accumulated (caller falls back)."""
        if self.xtx is None or self.count == 0:
            return None
        return (self.xtx.double() / self.count).float()

    def mean_sq(self) -> torch.Tensor | None:
        """Per-channel mean of x² (the imatrix value), float32, or None when empty."""
        if self.count == 0:
            return None
        return (self.sum_sq / self.count).float()

    def state(self) -> dict:
        """Plain tensors for saving: `sum_sq` (float64), `count`, and `xtx` when full."""
        d = {"sum_sq": self.sum_sq.cpu(), "count": self.count}
        if self.xtx is not None:
            d["xtx"] = self.xtx.cpu()
        return d

    def __repr__(self) -> str:
        return f"HessianAccumulator(dim={self.dim}, full={self.full}, count={self.count})"
