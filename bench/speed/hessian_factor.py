"""The Hessian rounding's factor U (H⁻¹ = UᵀU, upper) for a stack of per-expert Hessians, two ways side by side:
the Cholesky of H⁻¹ after forming H⁻¹ (what `upper_inverse_factor` did) and the triangular inverse of the
Cholesky of the order-reversed H (what it does now). Prints the seconds of each, their ratio, the largest relative
difference and how many entries differ once cast to float32 (the rounding reads U in float32).

    python bench/speed/hessian_factor.py --json OUT.json [--experts 32] [--width 4096] [--device cuda] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mixq.quant.ggml.rounding import hessian as kh


def inverse_then_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """The former factor: L = chol(H + λI), H⁻¹ from L, U = chol(H⁻¹) upper (no retries: the inputs are damped)."""
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    mean = diag.mean(-1, keepdim=True)
    low = torch.linalg.cholesky(h + torch.diag_embed(damp * mean.expand_as(diag)))
    return torch.linalg.cholesky(torch.cholesky_inverse(low), upper=True)


def hessians(experts: int, width: int, tokens: int, dev: torch.device) -> torch.Tensor:
    """Per-expert input Hessians of calibration-like inputs (a few hundred tokens each, uneven column scales)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    scale = torch.rand(width, generator=g, dtype=torch.float64) * 3
    out = torch.empty(experts, width, width, dtype=torch.float64, device=dev)
    for e in range(experts):
        x = (torch.randn(tokens, width, generator=g, dtype=torch.float64) * scale).to(dev)
        out[e] = x.T @ x / tokens
    return out


def timed(fn, h: torch.Tensor, repeat: int) -> tuple[float, torch.Tensor]:
    u = fn(h)  # warm-up (library handles, workspaces)
    best = float("inf")
    for _ in range(repeat):
        if h.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        u = fn(h)
        if h.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, u


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--experts", type=int, default=32, help="Hessians per call (the converter's slice on a GPU)")
    ap.add_argument("--width", type=int, default=4096, help="input width (GLM-5.3-Flash's hidden size)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens behind each Hessian")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    dev = torch.device(a.device)
    h = hessians(a.experts, a.width, a.tokens, dev)
    damp = 0.1
    t_old, u_old = timed(lambda x: inverse_then_cholesky(x, damp), h, a.repeat)
    t_new, u_new = timed(lambda x: kh.upper_inverse_factor(x, damp), h, a.repeat)
    rel = float((u_old - u_new).abs().max() / u_old.abs().max())
    differ = int((u_old.float() != u_new.float()).sum())
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "experts": a.experts,
           "width": a.width, "inverse_then_cholesky_s": round(t_old, 4), "reversed_cholesky_s": round(t_new, 4),
           "ratio": round(t_old / t_new, 2), "max_rel_diff": rel, "float32_entries_differing": differ,
           "entries": u_old.numel()}
    print(f"{a.experts} x ({a.width} x {a.width}) float64 on {res['device']}: Cholesky of H⁻¹ {t_old:.4f} s, "
          f"reversed Cholesky {t_new:.4f} s (x{res['ratio']}); max rel diff {rel:.2e}, "
          f"{differ} of {u_old.numel()} float32 entries differ")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
