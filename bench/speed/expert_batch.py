"""Trellis encode of GLM-5.3-Flash routed experts at several stack sizes: how much the stacked call buys.

A routed expert's gate/up is 2048 x 4096 (a 4096 x 4096 input Hessian), its down 4096 x 2048. LDLQ walks a unit
16 input rows at a time and encodes each strip's tiles in one Viterbi call, so a strip of one expert is only
out/16 tiles; stacking E experts makes each call E times wider. This prints, per shape and stack size E, the
seconds per expert and M weights/s of `quant.trellis.quantize` (unprofiled, synchronised, after one warm-up), then
one profiled call's per-phase split. The pipeline's stack size is `convert.pipeline.batches` (MAX_BATCH,
MAX_BATCH_ELEMS); the `pipeline_stack` field says which E it picks for each shape.

    python bench/speed/expert_batch.py --json OUT.json [--stacks 1,2,4,10,16] [--bits 3] [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from mixq.conversion.exl3.pipeline import MAX_BATCH, MAX_BATCH_ELEMS
from mixq.quant.trellis.encoder import quantize_with_stats

SHAPES = {"gate_up": (2048, 4096), "down": (4096, 2048)}  # (out, in) of one routed expert
TOKENS = 2048  # calibration tokens behind each Hessian


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def inputs(e: int, shape: tuple[int, int], dev: torch.device, seed: int = 0):
    """E expert weights (N(0, 0.02) with a few loud input channels) and their Hessians X^T X."""
    g = torch.Generator(device=dev).manual_seed(seed)
    out_f, in_f = shape
    w = torch.randn(e, out_f, in_f, generator=g, device=dev) * 0.02
    w[:, :, : max(1, in_f // 200)] *= 8.0
    x = torch.randn(e, TOKENS, in_f, generator=g, device=dev)
    h = torch.bmm(x.transpose(1, 2), x)
    return w, h


def pipeline_stack(shape: tuple[int, int]) -> int:
    """The stack size convert.pipeline.batches gives units of this shape with a Hessian."""
    out_f, in_f = shape
    return max(1, min(MAX_BATCH, MAX_BATCH_ELEMS // (out_f * in_f + in_f * in_f)))


def measure(e: int, shape: tuple[int, int], bits: float, dev: torch.device) -> dict:
    w, h = inputs(e, shape, dev)
    quantize_with_stats(w[:1], bits, h[:1])  # warm-up: kernel compiles, allocator
    _sync(dev)
    t0 = time.perf_counter()
    quantize_with_stats(w, bits, h)
    _sync(dev)
    sec = time.perf_counter() - t0
    _, stats = quantize_with_stats(w, bits, h, profile=True)
    n = w.numel()
    return {"stack": e, "seconds": round(sec, 3), "seconds_per_expert": round(sec / e, 4),
            "mweights_per_s": round(n / sec / 1e6, 2),
            "phases_profiled_s": {k: round(v, 3) for k, v in stats.seconds.items()},
            "peak_gpu_mib": round(torch.cuda.max_memory_allocated(dev) / 2**20, 1) if dev.type == "cuda" else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--stacks", default="1,2,4,10,16")
    ap.add_argument("--bits", type=float, default=3.0)
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds: stop starting new measurements after")
    ap.add_argument("--divide", type=int, default=1, help="shapes divided by this (a CPU smoke of the script)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    t_start = time.time()
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "bits": a.bits,
           "max_batch": MAX_BATCH, "max_batch_elems": MAX_BATCH_ELEMS, "shapes": {}, "skipped": []}
    for name in a.shapes.split(","):
        shape = tuple(d // a.divide for d in SHAPES[name])
        rows = []
        res["shapes"][name] = {"shape": list(shape), "pipeline_stack": pipeline_stack(shape), "runs": rows}
        for e in (int(s) for s in a.stacks.split(",")):
            if time.time() - t_start > a.budget:
                res["skipped"].append(f"{name} x{e}")
                continue
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            r = measure(e, shape, a.bits, dev)
            rows.append(r)
            print(f"{name} {shape} x{e}: {r['seconds']} s, {r['seconds_per_expert']} s/expert, "
                  f"{r['mweights_per_s']} M w/s  {r['phases_profiled_s']}", flush=True)
            a.json.write_text(json.dumps(res, indent=2))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    res["seconds"] = round(time.time() - t_start, 1)
    a.json.write_text(json.dumps(res, indent=2))
    json.dump(res, sys.stdout)
    print()


if __name__ == "__main__":
    main()
