"""The two CPU backends of the ggml registry side by side: numpy ports vs the torch encoders on CPU, one thread.

Decides where the numpy ports live: as the CPU backend of the registry when torch on CPU is slower than 1.2x
numpy, else as the test oracle only. Same rows and imatrix for both; the bytes are asserted equal.

    python bench/speed/ggml_backends.py --json bench/results/ggml_backends_cpu.json
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from mixq.quant.ggml import encoders

TYPES = ("Q4_K", "Q6_K", "Q3_K", "IQ4_XS", "Q8_0", "IQ2_S")


def best_of(fn, reps: int = 2) -> tuple[float, np.ndarray]:
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=4096)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.rows, a.cols)).astype(np.float32)
    im = rng.random(a.cols).astype(np.float32) + 0.1
    rows = {}
    for t in TYPES:
        tn, bn = best_of(lambda: encoders.quantize(x, t, im))
        tt, bt = best_of(lambda: encoders.quantize_tensor(torch.from_numpy(x), t, torch.from_numpy(im)).numpy())
        assert (bn == bt).all(), t
        rows[t] = {"numpy_s": round(tn, 4), "torch_cpu_s": round(tt, 4), "torch_over_numpy": round(tt / tn, 2)}
        print(f"{t:8s} numpy {tn:.3f} s  torch-cpu {tt:.3f} s  torch/numpy {tt / tn:.2f}x", flush=True)
    res = {"rows": a.rows, "cols": a.cols, "threads": 1, "types": rows,
           "numpy_stays_cpu_backend": any(r["torch_over_numpy"] > 1.2 for r in rows.values())}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
