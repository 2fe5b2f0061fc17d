"""mixq's trellis encoder against exllamav3 1.6.5's `quantize_tiles`, side by side on one GPU, in one call.

    python bench/trellis_vs_exllamav3.py --json out.json                 # everything (needs CUDA + exllamav3)
    python bench/trellis_vs_exllamav3.py --json out.json --no-exllamav3  # mixq only
    python bench/trellis_vs_exllamav3.py --json out.json --quick         # encoder table only, fewer tiles

Parts (each written to the JSON as it completes, so a time-out still leaves the finished parts):
1. gpu tests: `pytest -m gpu tests/quant/test_viterbi_fused.py` (the fused kernel against the torch path).
2. encoder: the same N(0,1) tiles (default 32768) through both encoders at K = 2, 3, 4 with mul1 and 3inst; each
   encoder at its own best input scale (a 5-point grid around the prior on 2048 tiles, then all tiles);
   MSE/D(R) = mean((Q(g·x)/g − x)²) / 2^(−2K) and weights/s (the kernel time, synchronised, compile excluded).
3. micro: mixq's fused encoder alone at several tile counts and K (weights/s).
4. end to end: mixq's `trellis.quantize` on a stacked (32, 2048, 4096) expert batch with a Hessian (weights/s and
   the per-phase split), K = 2, 2.5, 3, 4 (2.5: the routed experts of the 108 GB GLM-5.3-Flash plan).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from mixq.quant import codebooks as cb
from mixq.quant import trellis, viterbi, viterbi_fused

REPO = Path(__file__).resolve().parents[1]
SCALE_GRID = (0.94, 0.97, 1.0, 1.03, 1.06)


def _sync():
    torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t0


def mixq_encoder(codebook: str, bits: int):
    """tiles (T, 256) float32 → reconstructed values, through the fused kernel (what trellis.quantize runs)."""
    table = cb.codebook_table(codebook, "cuda")
    table16 = table.half()

    def run(tiles):
        return table[viterbi_fused.encode(tiles, table16, bits)]
    return run


def exllamav3_encoder(codebook: str, bits: int):
    from exllamav3.modules.quant.exl3_lib.quantize import quantize_tiles

    args = {"K": bits, "mul1": codebook == "mul1", "mcg": codebook == "mcg"}

    def run(tiles):
        return quantize_tiles(tiles.contiguous(), args)[0]
    return run


def _mse(run, x, g):
    q = run(x * g)
    return float((q / g - x).square().mean())


def best_scale(run, x, g0):
    errs = {g0 * f: _mse(run, x, g0 * f) for f in SCALE_GRID}
    return min(errs, key=errs.get)


def encoder_table(tiles: int, ks, codebooks, with_exl3: bool, out: dict, save):
    x = torch.randn(tiles, 256, generator=torch.Generator().manual_seed(0)).cuda()
    xs = x[:2048]
    for codebook in codebooks:
        std = cb.CODEBOOK_STD[codebook]
        for k in ks:
            g0 = trellis.SCALE_PRIOR[codebook].get(float(k), 0.9) * std
            row = {"codebook": codebook, "bits": k, "tiles": tiles}
            encoders = {"mixq": mixq_encoder(codebook, k)}
            if with_exl3:
                encoders["exllamav3"] = exllamav3_encoder(codebook, k)
            for name, run in encoders.items():
                run(xs[:64] * g0)  # compile / JIT warm-up, not timed
                g = best_scale(run, xs, g0)
                q, dt = _timed(lambda: run(x * g))
                mse = float((q / g - x).square().mean())
                row[name] = {"scale": g, "mse_over_dr": mse / 2 ** (-2 * k), "seconds": dt,
                             "weights_per_s": x.numel() / dt}
            if with_exl3:
                row["speedup"] = row["mixq"]["weights_per_s"] / row["exllamav3"]["weights_per_s"]
                row["mse_over_dr_diff"] = row["mixq"]["mse_over_dr"] - row["exllamav3"]["mse_over_dr"]
            out["encoder"].append(row)
            msg = "  ".join(f"{n}: MSE/D(R) {row[n]['mse_over_dr']:.4f} {row[n]['weights_per_s'] / 1e6:.2f}M w/s"
                            for n in encoders)
            print(f"{codebook:5s} K={k}  {msg}" + (f"  speedup {row['speedup']:.2f}x" if with_exl3 else ""),
                  flush=True)
            save()


def micro(counts, ks, out: dict, save):
    table = cb.codebook_table("mul1", "cuda")
    table16 = table.half()
    for k in ks:
        viterbi_fused.encode(torch.randn(8, 256, device="cuda"), table16, k)  # compile
        for n in counts:
            x = torch.randn(n, 256, generator=torch.Generator().manual_seed(n)).cuda()
            _, dt = _timed(lambda: viterbi_fused.encode(x, table16, k))
            out["micro"].append({"bits": k, "tiles": n, "seconds": dt, "weights_per_s": x.numel() / dt})
            print(f"micro K={k} tiles={n}: {dt * 1e3:.1f} ms  {x.numel() / dt / 1e6:.2f}M w/s", flush=True)
        save()


def _hessian(e: int, n_in: int) -> torch.Tensor:
    """Synthetic activation Hessian with channel-scale spread and correlations (one, repeated per expert)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * n_in, n_in, generator=g) * torch.exp(torch.randn(n_in, generator=g) * 0.5)
    x = (x + 0.3 * x.roll(1, dims=1)).cuda()
    return (x.t() @ x).expand(e, n_in, n_in).contiguous()


def end_to_end(shape, ks, out: dict, save):
    e, out_f, in_f = shape
    w = (torch.randn(e, out_f, in_f, generator=torch.Generator().manual_seed(1)) * 0.02).cuda()
    h = _hessian(e, in_f)
    trellis.quantize(w[:1, :128, :128], 4, hessian=h[:1, :128, :128])  # warm-up (self-check, compiles)
    for k in ks:
        (qs, stats), dt = _timed(lambda: trellis.quantize_with_stats(w, k, hessian=h, profile=True))
        wd = torch.stack([q.dequantize() for q in qs])
        rel = float((wd - w).square().mean() / w.square().mean())
        row = {"shape": list(shape), "bits": k, "hessian": True, "seconds": dt, "weights_per_s": w.numel() / dt,
               "rel_mse": rel, "scale": stats.scale, "phases_s": {n: round(v, 3) for n, v in stats.seconds.items()}}
        out["end_to_end"].append(row)
        print(f"quantize {tuple(shape)} K={k} +Hessian: {dt:.1f}s  {w.numel() / dt / 1e6:.2f}M w/s  "
              f"rel_mse={rel:.3e}  phases={row['phases_s']}", flush=True)
        save()
        del qs, wd


def gpu_tests(out: dict, save):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                        "tests/quant/test_viterbi_fused.py"], cwd=REPO, capture_output=True, text=True)
    tail = (r.stdout + r.stderr).strip().splitlines()[-15:]
    out["gpu_tests"] = {"returncode": r.returncode, "seconds": round(time.perf_counter() - t0, 1), "tail": tail}
    print("gpu tests:", "passed" if r.returncode == 0 else "FAILED", "\n  " + "\n  ".join(tail[-5:]), flush=True)
    save()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="write the results to this file")
    ap.add_argument("--no-exllamav3", action="store_true", help="mixq only (exllamav3 not installed)")
    ap.add_argument("--tiles", type=int, default=32768)
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--codebooks", default="mul1,3inst")
    ap.add_argument("--quick", action="store_true", help="encoder table on 8192 tiles, mul1 only; no micro/e2e")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: tests,encoder,micro,e2e")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("trellis_vs_exllamav3: needs a CUDA device")
    ks = [int(b) for b in args.bits.split(",")]  # integer K: exllamav3's quantize_tiles table
    codebooks = ["mul1"] if args.quick else args.codebooks.split(",")
    skip = set(args.skip.split(",")) if args.skip else set()
    if args.quick:
        skip |= {"micro", "e2e"}
    import triton

    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "exllamav3": None, "gpu_tests": None, "encoder": [], "micro": [], "end_to_end": [], "errors": []}
    if not args.no_exllamav3:
        import exllamav3
        out["exllamav3"] = getattr(exllamav3, "__version__", "unknown")

    def save():
        Path(args.json).write_text(json.dumps(out, indent=1))

    parts = [("tests", lambda: gpu_tests(out, save)),
             ("encoder", lambda: encoder_table(8192 if args.quick else args.tiles, ks, codebooks,
                                               not args.no_exllamav3, out, save)),
             ("micro", lambda: micro([132, 1056, 4224, 16896], [1, 2, 2.5, 3, 4, 5, 6, 8], out, save)),
             ("e2e", lambda: end_to_end((32, 2048, 4096), sorted(set(ks) | {2.5}), out, save))]
    for name, part in parts:
        if name in skip:
            continue
        try:
            part()
        except Exception:
            traceback.print_exc()
            out["errors"].append({"part": name, "error": traceback.format_exc(limit=3)})
            save()
    out["fused_kernel_active"] = {k: viterbi.fused_ok(k) for k in ks}
    save()


if __name__ == "__main__":
    main()
