"""The trellis scale refit's solve, by LU (torch.linalg.solve, what the refit used) and by Cholesky
(quant.trellis.encoder.spd_solve), on Gram matrices of the refit's form at a routed expert's width.

    python bench/speed/trellis_refit.py [--device cuda] [--stack 16] [--k 4096] [--n 2048] [--json OUT.json]

The Gram matrix is (Q·Qᵀ)∘H plus the refit's 1e-6 ridge, from a random Q (k x n) and a damped Hessian of 2k
random outlier-scaled tokens; both solves run on the same matrices, each timed best of --repeat after a warm-up,
and the largest relative difference of their solutions is printed beside the times.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from mixq.quant.trellis.encoder import spd_solve
from mixq.quant.trellis.ldlq import damp


def gram_batch(stack: int, k: int, n: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(stack, k, k) float64 Gram matrices of the refit's form and (stack, k, 1) right-hand sides."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(stack, k, n, generator=g).to(device)
    x = torch.randn(stack, 2 * k, k, generator=g) * torch.rand(1, 1, k, generator=g).mul(4).exp()
    h = damp(torch.bmm(x.transpose(1, 2), x).double().to(device), 0.025).float()
    gram = torch.bmm(q, q.transpose(1, 2)) * h
    gram = gram + 1e-6 * torch.diagonal(gram, dim1=1, dim2=2).mean(1)[:, None, None] * torch.eye(k, device=device)
    rhs = torch.randn(stack, k, 1, generator=g).to(device)
    return gram.double(), rhs.double()


def timed(fn, device: torch.device, repeat: int) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up (library handles, workspace)
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--stack", type=int, default=16)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    gram, rhs = gram_batch(a.stack, a.k, a.n, dev)
    t_lu, x_lu = timed(lambda: torch.linalg.solve(gram, rhs), dev, a.repeat)
    t_ch, x_ch = timed(lambda: spd_solve(gram, rhs), dev, a.repeat)
    rel = float(((x_ch - x_lu).abs().amax() / x_lu.abs().amax()))
    out = {"device": str(dev), "stack": a.stack, "k": a.k, "n": a.n, "lu_s": round(t_lu, 4),
           "cholesky_s": round(t_ch, 4), "ratio": round(t_lu / t_ch, 3), "max_rel_diff": rel}
    print(f"{a.stack} x ({a.k} x {a.k}) float64 on {dev}: LU {t_lu:.4f} s, Cholesky {t_ch:.4f} s "
          f"(x{t_lu / t_ch:.2f}); solutions differ by {rel:.2e} of their largest entry")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
