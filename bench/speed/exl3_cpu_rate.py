"""Trellis encode rate on the CPU, in weights per CPU-second (= per core): the figure behind `mixq convert`'s
up-front time estimate for EXL3 on a machine without a GPU (conversion/exl3/estimate.py, CPU_WEIGHTS_PER_CORE_S).

    python bench/speed/exl3_cpu_rate.py --json bench/results/exl3_cpu_rate.json [--bits 2,3,4] [--shape 128x256]

CPU time (process_time: every thread of the process) rather than wall time, so a busy machine reads about the
same rate as an idle one; the estimate divides by the cores torch uses. One matrix per rate with a synthetic
Hessian (the pipeline's LDLQ path), after a small warm-up quantize.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from mixq.quant import trellis


def _hessian(n_in: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n_in, n_in, generator=g) * torch.exp(torch.randn(n_in, generator=g) * 0.5)
    return x.t() @ x


def measure(shape: tuple[int, int], bits: list[float]) -> list[dict]:
    """One row per rate: CPU seconds, wall seconds and weights per CPU-second of `trellis.quantize`."""
    g = torch.Generator().manual_seed(1)
    out_f, in_f = shape
    w = torch.randn(out_f, in_f, generator=g) * 0.02
    h = _hessian(in_f)
    trellis.quantize(w[:16], bits[0], hessian=h)  # first-call set-up (codebook tables) outside the timing
    rows = []
    for k in bits:
        c0, t0 = time.process_time(), time.perf_counter()
        trellis.quantize(w, k, hessian=h)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        rows.append({"bits": k, "shape": list(shape), "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
                     "weights_per_cpu_s": round(w.numel() / cpu, 1)})
        print(f"K={k}: {cpu:.1f} CPU-s ({wall:.1f} s wall), {w.numel() / cpu:.0f} weights per CPU-second",
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", default="2,3,4", help="comma-separated trellis rates")
    ap.add_argument("--shape", default="128x256", help="OUTxIN of the matrix")
    ap.add_argument("--json", default=None, help="write the rows and the median rate to this file")
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split("x"))
    rows = measure(shape, [float(b) for b in a.bits.split(",")])
    res = {"threads": torch.get_num_threads(), "load_avg_1min": round(os.getloadavg()[0], 1), "rows": rows,
           "median_weights_per_cpu_s": statistics.median(r["weights_per_cpu_s"] for r in rows)}
    print(f"median: {res['median_weights_per_cpu_s']:.0f} weights per CPU-second")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
