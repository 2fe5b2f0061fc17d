"""Trellis quantizer benchmark: distortion vs the rate–distortion bound and encode throughput.

    python bench/speed/trellis.py                       # CPU: small distortion table + CPU throughput
    python bench/speed/trellis.py --device cuda         # H200: full table (256×1024) + GLM-5.3-Flash expert shapes
    python bench/speed/trellis.py --json out.json

Distortion: mean((W−Ŵ)²)/mean(W²) on i.i.d. N(0,1) weights, no Hessian, divided by 2^(−2K).
Throughput: weights/s of `quantize` on stacked experts with a synthetic Hessian (the pipeline's path) and
without; the per-phase time split comes from trellis.quantize_with_stats(profile=True).
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from mixq.quant import trellis

from mixq.quant.trellis import viterbi

RATES = {"mul1": [1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8], "3inst": [1, 2, 3, 4, 5, 6, 7, 8],
         "mcg": [1, 2, 3, 4, 5, 6, 7, 8]}
EXL3_REF = {2: 1.097, 3: 1.120, 4: 1.140}  # exllamav3 1.6.5 CUDA encoder, mul1


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def distortion_table(dev, shape, codebooks, rates_filter=None):
    rows = []
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g).to(dev)
    for name in codebooks:
        for k in RATES[name]:
            if rates_filter and k not in rates_filter:
                continue
            _sync(dev)
            t0 = time.perf_counter()
            q, stats = trellis.quantize_with_stats(w, k, codebook=name, seed=1)
            _sync(dev)
            dt = time.perf_counter() - t0
            rel = float((q.dequantize() - w).square().mean() / w.square().mean())
            row = {"codebook": name, "bits": k, "shape": list(shape), "rel_mse": rel, "scale": stats.scale,
                   "ratio": rel / 2 ** (-2 * k), "seconds": dt, "weights_per_s": w.numel() / dt}
            rows.append(row)
            ref = EXL3_REF.get(k) if name == "mul1" else None
            print(f"  {name:5s} K={k:<4} rel_mse={rel:.3e}  ratio={row['ratio']:.3f}  g={row['scale']:.3f}"
                  f"{'  (exllamav3 %.3f)' % ref if ref else ''}  {dt:.1f}s", flush=True)
    return rows


def _hessian(e, n_in, dev, seed=0):
    """Synthetic activation Hessian with channel-scale spread and correlations (one, repeated per expert)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n_in, n_in, generator=g) * torch.exp(torch.randn(n_in, generator=g) * 0.5)
    x = (x + 0.3 * x.roll(1, dims=1)).to(dev)
    return (x.t() @ x).expand(e, n_in, n_in).clone()


_DEADLINE = [float("inf")]


def throughput(dev, shapes, experts, rates, hessian=True):
    rows = []
    for (out_f, in_f) in shapes:
        if time.perf_counter() > _DEADLINE[0]:
            print("  (time budget spent: skipped)", flush=True)
            return rows
        g = torch.Generator().manual_seed(1)
        w = (torch.randn(experts, out_f, in_f, generator=g) * 0.02).to(dev)
        h = _hessian(experts, in_f, dev) if hessian else None
        for k in rates:
            if time.perf_counter() > _DEADLINE[0]:
                print("  (time budget spent: skipped)", flush=True)
                return rows
            _sync(dev)
            t0 = time.perf_counter()
            qs, stats = trellis.quantize_with_stats(w, k, hessian=h, profile=True)
            _sync(dev)
            dt = time.perf_counter() - t0
            wd = torch.stack([q.dequantize() for q in qs])
            rel = float((wd - w).square().mean() / w.square().mean())
            split = {kk: round(v, 3) for kk, v in stats.seconds.items()}
            row = {"shape": [out_f, in_f], "experts": experts, "bits": k, "hessian": hessian, "seconds": dt,
                   "weights_per_s": w.numel() / dt, "rel_mse": rel, "phases_s": split}
            rows.append(row)
            print(f"  {out_f}x{in_f} ×{experts} K={k} hessian={hessian}: {dt:.2f}s  "
                  f"{w.numel() / dt / 1e6:.3f}M weights/s  rel_mse={rel:.2e}  phases={split}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="write all rows to this file")
    ap.add_argument("--dist-shape", default=None, help="OUTxIN for the distortion table")
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--skip-dist", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--quick", action="store_true", help="GPU: only K=4 throughput rows")
    ap.add_argument("--budget", type=float, default=None, help="stop starting throughput runs after this many s")
    args = ap.parse_args()
    if args.budget:
        _DEADLINE[0] = time.perf_counter() + args.budget
    dev = torch.device(args.device)
    gpu = dev.type == "cuda"
    result = {"device": torch.cuda.get_device_name(dev) if gpu else "cpu", "distortion": [], "throughput": []}
    if gpu:
        print(result["device"], "triton ACS:", viterbi._triton_ok("acs"), "triton pass:", viterbi._triton_ok("pass"))
        result["triton"] = viterbi._triton_ok("pass")

    if not args.skip_dist:
        shape = tuple(int(x) for x in args.dist_shape.split("x")) if args.dist_shape else \
            ((256, 1024) if gpu else (128, 128))
        print(f"distortion on N(0,1) {shape[0]}x{shape[1]} (ratio = rel_mse / 2^-2K):", flush=True)
        try:
            cbs = ["mul1", "3inst", "mcg"]
            result["distortion"] = distortion_table(dev, shape, cbs, None if gpu else [2, 3, 4])
            if gpu:
                big = (1024, 2048)
                print(f"distortion on N(0,1) {big[0]}x{big[1]}, mul1 K=2,3,4:", flush=True)
                result["distortion"] += distortion_table(dev, big, ["mul1"], [2, 3, 4])
                print(f"short seam window (the CPU default) instead of the full ring, {shape[0]}x{shape[1]}:",
                      flush=True)
                for k in (1, 2, 3, 4):
                    viterbi.WARM = viterbi.default_warm(k)
                    rows = distortion_table(dev, shape, ["mul1"], [k])
                    for r in rows:
                        r["warm"] = viterbi.WARM
                    result["distortion"] += rows
                viterbi.WARM = None
        except Exception:
            traceback.print_exc()

    if not args.skip_speed:
        try:
            if gpu:
                e = args.experts or 8
                print(f"throughput, GLM-5.3-Flash expert shapes (out×in), batches of {e}, Hessian (LDLQ):", flush=True)
                result["throughput"] += throughput(dev, [(2048, 4096)], e, [4] if args.quick else [4, 2, 6])
                result["throughput"] += throughput(dev, [(4096, 2048)], e, [4])
                if args.quick:
                    raise SystemExit(_dump(result, args.json))
                print("throughput without Hessian:", flush=True)
                result["throughput"] += throughput(dev, [(2048, 4096)], e, [4], hessian=False)
                print("batch scaling (K=4, Hessian, 1 and 32 experts):", flush=True)
                result["throughput"] += throughput(dev, [(2048, 4096)], 1, [4])
                result["throughput"] += throughput(dev, [(2048, 4096)], 32, [4])
            else:
                print("CPU throughput (128×256 single Linear):", flush=True)
                result["throughput"] += throughput(dev, [(128, 256)], args.experts or 1, [2, 4, 6])
        except Exception:
            traceback.print_exc()

    _dump(result, args.json)


def _dump(result, path):
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
