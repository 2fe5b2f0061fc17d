"""mixq's trellis encoder against exllamav3 1.6.5's `quantize_tiles`, side by side on one GPU, in one call.

    python bench/speed/trellis_vs_exllamav3.py --json out.json                 # everything (needs CUDA + exllamav3)
    python bench/speed/trellis_vs_exllamav3.py --json out.json --no-exllamav3  # mixq only
    python bench/speed/trellis_vs_exllamav3.py --json out.json --quick         # encoder table only, fewer tiles

Parts (each written to the JSON as it completes, so a time-out still leaves the finished parts):
1. gpu tests: `pytest -m gpu tests/quant/test_viterbi_fused.py tests/quant/test_viterbi_gluon.py` (the fused
   kernel, both forwards, against the torch path).
2. kernels: registers, spills and shared memory of the fused forward kernel per rate and cost arithmetic.
3. encoder: the same N(0,1) tiles (default 32768) through the per-step torch path (the reference), mixq's fused
   encoder (``mixq``: the default arithmetic, ``mixed`` at these K; with mul1 also ``mixq_fp32``, ``mixq_fp16``,
   ``mixq_exact``) and exllamav3, at K = 2, 3, 4 with mul1 and 3inst; each at its own best input scale (a
   5-point grid around the prior on 2048 tiles, then all tiles); MSE/D(R) = mean((Q(g·x)/g − x)²) / 2^(−2K) and
   weights/s (kernel time, synchronised, compile excluded, best of two). Each fused variant is also run at the
   torch path's scale: ``mse_over_dr_vs_torch_path`` is that paired difference (the precision cost of the
   arithmetic alone, free of scale-grid and sampling noise).
4. micro: the fused encoder at several tile counts and K (weights/s), default arithmetic; the others at K=2,3,4;
   where the Gluon forward is the default (integer K = 2..4) the Triton forward beside it (``forward``); at K = 2
   also the gather lowering of the Triton forward's cost exchange (``mixed+gather``).
5. end to end: mixq's `trellis.quantize` on a stacked (32, 2048, 4096) expert batch with a Hessian (weights/s and
   the per-phase split), K = 2, 2.5, 3, 4 (2.5: the routed experts of the 108 GB GLM-5.3-Flash plan).
The summary names, per K, each variant's speed-up and precision cost, and the fastest variant that is both
≥ 1.0x exllamav3 and within 0.0005 MSE/D(R) of the torch path at every K (``recommended_costs``). Micro and end
to end stop early (recorded under ``skipped``) when the run nears ``--budget`` seconds.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from mixq.quant.trellis import codebooks as cb
from mixq.quant import trellis
from mixq.quant.trellis import viterbi
from mixq.quant.trellis import viterbi_triton as viterbi_fused

REPO = Path(__file__).resolve().parents[2]
SCALE_GRID = (0.94, 0.97, 1.0, 1.03, 1.06)
VARIANTS = ("mixed", "fp32", "fp16", "exact")  # the fused kernel's cost arithmetic (viterbi_fused.COST_MODES)
REF_CHUNK = 4096  # tiles per call of the per-step path (its uint8 backpointers: 4 MB per tile at K = 2)
PRECISION_AIM = 5e-4  # MSE/D(R) within this of the torch path


def _sync():
    torch.cuda.synchronize()


def _timed(fn, repeat: int = 1):
    best, out = float("inf"), None
    for _ in range(repeat):
        _sync()
        t0 = time.perf_counter()
        out = fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return out, best


def mixq_encoder(codebook: str, bits: float, costs: str):
    """tiles (T, 256) float32 → reconstructed values, through the fused kernel (what trellis.quantize runs)."""
    table = cb.codebook_table(codebook, "cuda")
    table16 = table.half()

    def run(tiles):
        return table[viterbi_fused.encode(tiles, table16, bits, costs=costs)]
    return run


def torch_path_encoder(codebook: str, bits: float):
    """The per-step path with the full-ring seam pass: what the fused kernel must match."""
    table = cb.codebook_table(codebook, "cuda")

    def run(tiles):
        return torch.cat([table[viterbi.viterbi_tiles_reference(tiles[i:i + REF_CHUNK], table, float(bits))]
                          for i in range(0, tiles.shape[0], REF_CHUNK)])
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


def _encode_row(codebook: str, k: int, x: torch.Tensor, with_exl3: bool, variants) -> dict:
    xs = x[:2048]
    g0 = trellis.SCALE_PRIOR[codebook].get(float(k), 0.9) * cb.CODEBOOK_STD[codebook]
    dr = 2.0 ** (-2 * k)
    default = viterbi_fused.default_costs(k)
    encoders = {"torch_path": (torch_path_encoder(codebook, k), 1)}
    for v in [default] + [v for v in variants if v != default]:
        encoders["mixq" if v == default else f"mixq_{v}"] = (mixq_encoder(codebook, k, v), 2)
    if with_exl3:
        encoders["exllamav3"] = (exllamav3_encoder(codebook, k), 2)
    row = {"codebook": codebook, "bits": k, "tiles": x.shape[0]}
    for name, (run, repeat) in encoders.items():
        run(xs[:64] * g0)  # compile / JIT warm-up, not timed
        g = best_scale(run, xs, g0)
        q, dt = _timed(lambda: run(x * g), repeat)
        row[name] = {"scale": g, "mse_over_dr": float((q / g - x).square().mean()) / dr, "seconds": dt,
                     "weights_per_s": x.numel() / dt}
        del q
    g_ref = row["torch_path"]["scale"]
    for name, (run, _) in encoders.items():
        if not name.startswith("mixq"):
            continue
        r = row[name]
        r["costs"] = name[5:] or default
        at_ref = r["mse_over_dr"] if r["scale"] == g_ref else _mse(run, x, g_ref) / dr
        r["mse_over_dr_vs_torch_path"] = at_ref - row["torch_path"]["mse_over_dr"]
        if with_exl3:
            r["speedup"] = r["weights_per_s"] / row["exllamav3"]["weights_per_s"]
    return row


def encoder_table(tiles: int, ks, codebooks, with_exl3: bool, out: dict, save):
    x = torch.randn(tiles, 256, generator=torch.Generator().manual_seed(0)).cuda()
    for codebook in codebooks:
        for k in ks:
            row = _encode_row(codebook, k, x, with_exl3, VARIANTS if codebook == "mul1" else ())
            out["encoder"].append(row)
            names = [n for n in row if isinstance(row[n], dict)]
            msg = "  ".join(f"{n}: {row[n]['mse_over_dr']:.4f} {row[n]['weights_per_s'] / 1e6:.1f}M"
                            + (f" ({row[n]['mse_over_dr_vs_torch_path']:+.5f}"
                               + (f", {row[n]['speedup']:.2f}x)" if "speedup" in row[n] else ")")
                               if n.startswith("mixq") else "") for n in names)
            print(f"{codebook:5s} K={k}  {msg}", flush=True)
            save()


def summarize(out: dict, with_exl3: bool) -> None:
    """Per K (mul1 rows): each variant's speed-up and precision cost; the fastest variant meeting both aims."""
    rows = [r for r in out["encoder"] if r["codebook"] == "mul1"]
    summary = {}
    for r in rows:
        summary[str(r["bits"])] = {
            r[n]["costs"]: {"speedup": r[n].get("speedup"), "weights_per_s": r[n]["weights_per_s"],
                            "mse_over_dr_vs_torch_path": r[n]["mse_over_dr_vs_torch_path"]}
            for n in r if n.startswith("mixq")}
    ok = [v for v in VARIANTS if rows and all(
        abs(s[v]["mse_over_dr_vs_torch_path"]) <= PRECISION_AIM and (not with_exl3 or s[v]["speedup"] >= 1.0)
        for s in summary.values())]
    out["summary"] = summary
    out["recommended_costs"] = max(  # the highest geometric-mean speed over K
        ok, key=lambda v: sum(math.log(s[v]["weights_per_s"]) for s in summary.values())) if ok else None
    for k, s in summary.items():
        print(f"K={k}: " + "  ".join(f"{v} {d['mse_over_dr_vs_torch_path']:+.5f}"
                                    + (f" {d['speedup']:.2f}x" if d["speedup"] else "") for v, d in s.items()))
    print("recommended cost arithmetic:", out["recommended_costs"],
          "(default: " + ", ".join(f"K={k} {viterbi_fused.default_costs(float(k))}" for k in summary) + ")")


def kernel_resources(out: dict, save):
    """Registers / spills / shared memory of the forward kernels per rate and cost arithmetic."""
    for bits in (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8):
        for costs in VARIANTS:
            if costs != viterbi_fused.default_costs(bits) and bits not in (2, 3, 4):
                continue
            for exchange in ("reshape", "gather") if (bits, costs) == (2, "mixed") else ("reshape",):
                res = viterbi_fused.forward_resources(bits, costs, exchange=exchange)
                name = costs + ("" if exchange == "reshape" else f"+{exchange}")
                out["kernels"].append({"bits": bits, "costs": name, **res})
                print(f"kernel K={bits} {name}: " + ", ".join(
                    f"{p} {r['n_regs']} regs {r['n_spills']} spills {r['shared']} B shared" for p, r in res.items()),
                    flush=True)
        save()


def _out_of_time(out: dict, deadline: float, need_s: float, what: str) -> bool:
    """Whether ``what`` (expected to take ``need_s``) would end past the deadline; if so it is recorded as skipped."""
    if time.perf_counter() + need_s <= deadline:
        return False
    out["skipped"].append(what)
    print(f"skipped (time budget): {what}", flush=True)
    return True


def micro(counts, ks, out: dict, save, deadline: float):
    table16 = cb.codebook_table("mul1", "cuda").half()
    runs = [(k, None, "reshape", None, counts) for k in ks]
    runs += [(k, v, "reshape", None, counts[-2:]) for k in (2, 3, 4) for v in VARIANTS
             if v != viterbi_fused.default_costs(k)]
    # the Gluon forward where it applies: the two forwards side by side
    runs += [(k, None, "reshape", "gluon", counts) for k in ks if viterbi_fused.gluon_serves(k)]
    runs += [(2, None, "gather", "triton", counts[-2:])]  # the other lowering of the Triton forward's exchange
    for k, costs, exchange, forward, ns in runs:
        name = (costs or viterbi_fused.default_costs(k)) + ("" if exchange == "reshape" else f"+{exchange}")
        forward = forward or viterbi_fused.default_forward(k, costs)
        if _out_of_time(out, deadline, 5.0, f"micro K={k} {name} {forward}"):
            continue
        enc = functools.partial(viterbi_fused.encode, table16=table16, bits=k, costs=costs, exchange=exchange,
                                forward=forward)
        enc(torch.randn(8, 256, device="cuda"))
        for n in ns:
            x = torch.randn(n, 256, generator=torch.Generator().manual_seed(n)).cuda()
            _, dt = _timed(lambda: enc(x), 2)
            out["micro"].append({"bits": k, "costs": name, "forward": forward, "tiles": n, "seconds": dt,
                                 "weights_per_s": x.numel() / dt})
            print(f"micro K={k} {name} {forward} tiles={n}: {dt * 1e3:.1f} ms  {x.numel() / dt / 1e6:.2f}M w/s",
                  flush=True)
        save()


def _hessian(e: int, n_in: int) -> torch.Tensor:
    """Synthetic activation Hessian with channel-scale spread and correlations (one, repeated per expert)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * n_in, n_in, generator=g) * torch.exp(torch.randn(n_in, generator=g) * 0.5)
    x = (x + 0.3 * x.roll(1, dims=1)).cuda()
    return (x.t() @ x).expand(e, n_in, n_in).contiguous()


def end_to_end(shape, ks, out: dict, save, deadline: float):
    e, out_f, in_f = shape
    w = (torch.randn(e, out_f, in_f, generator=torch.Generator().manual_seed(1)) * 0.02).cuda()
    h = _hessian(e, in_f)
    trellis.quantize(w[:1, :128, :128], 4, hessian=h[:1, :128, :128])  # warm-up (self-check, compiles)
    need = 20.0  # seconds per K until one is measured
    for k in ks:
        if _out_of_time(out, deadline, need, f"end to end K={k}"):
            continue
        (qs, stats), dt = _timed(lambda: trellis.quantize_with_stats(w, k, hessian=h, profile=True))
        need = 1.2 * dt
        wd = torch.stack([q.dequantize() for q in qs])
        rel = float((wd - w).square().mean() / w.square().mean())
        row = {"shape": list(shape), "bits": k, "hessian": True, "costs": viterbi_fused.default_costs(k),
               "fused": viterbi.fused_ok(k), "seconds": dt, "weights_per_s": w.numel() / dt, "rel_mse": rel,
               "scale": stats.scale, "phases_s": {n: round(v, 3) for n, v in stats.seconds.items()}}
        out["end_to_end"].append(row)
        print(f"quantize {tuple(shape)} K={k} +Hessian: {dt:.1f}s  {w.numel() / dt / 1e6:.2f}M w/s  "
              f"rel_mse={rel:.3e}  phases={row['phases_s']}", flush=True)
        save()
        del qs, wd


def gpu_tests(out: dict, save):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                        "tests/quant/test_viterbi_fused.py", "tests/quant/test_viterbi_gluon.py"],
                       cwd=REPO, capture_output=True, text=True)
    tail = [line.replace(str(REPO) + "/", "") for line in (r.stdout + r.stderr).strip().splitlines()[-15:]]
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
    ap.add_argument("--skip", default="", help="comma list of parts to skip: tests,kernels,encoder,micro,e2e")
    ap.add_argument("--budget", type=float, default=330.0,
                    help="seconds: micro and end to end skip what would end later (default 330)")
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
           "exllamav3": None, "gpu_tests": None, "kernels": [],
           "default_costs": {str(k): viterbi_fused.default_costs(k) for k in (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)},
           "encoder": [], "micro": [], "end_to_end": [], "skipped": [], "errors": []}
    if not args.no_exllamav3:
        import exllamav3
        out["exllamav3"] = getattr(exllamav3, "__version__", "unknown")

    def save():
        Path(args.json).write_text(json.dumps(out, indent=1))

    t_start = time.perf_counter()
    deadline = t_start + args.budget
    parts = [("tests", lambda: gpu_tests(out, save)),
             ("kernels", lambda: kernel_resources(out, save)),
             ("encoder", lambda: encoder_table(8192 if args.quick else args.tiles, ks, codebooks,
                                               not args.no_exllamav3, out, save)),
             ("summary", lambda: summarize(out, not args.no_exllamav3)),
             ("micro", lambda: micro([132, 1056, 4224, 16896], [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8], out, save,
                                     deadline)),
             ("e2e", lambda: end_to_end((32, 2048, 4096), sorted(set(ks) | {2.5}), out, save, deadline))]
    for name, part in parts:
        if name in skip or (name == "summary" and "encoder" in skip):
            continue
        t0 = time.perf_counter()
        try:
            part()
        except Exception:
            traceback.print_exc()
            out["errors"].append({"part": name, "error": traceback.format_exc(limit=3)})
        out.setdefault("part_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        save()
    out["fused_kernel_active"] = {k: viterbi.fused_ok(k) for k in ks}
    out["fused_forward"] = {k: viterbi.fused_forward(k) for k in ks}
    out["total_seconds"] = round(time.perf_counter() - t_start, 1)
    save()


if __name__ == "__main__":
    main()
