"""Encode speed: mixq.quant.kquants vs ggml's quantizer (ggml_quantize_chunk via ctypes).

Same process, same tensors, one thread each (numpy elementwise ops and ggml_quantize_chunk
both run on the calling thread). Prints Mweights/s for both and the time ratio mixq/ggml
("cpu ratio" 4.0 = mixq takes 4x ggml's CPU time), with and
without an importance matrix, and checks the bytes are identical while at it.
Times are CPU seconds of this process (robust on a shared machine); wall seconds are printed too.

    python bench/kquant_speed.py [--model ../shared/models/glm5next-k256] [--types Q4_K,Q6_K]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")

from mixq.quant import kquants, kquants_ggml  # noqa: E402

TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q8_0", "Q4_0", "Q5_0", "Q5_1"]
# also: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (--types; the IQ2_XXS/XS rows run with an imatrix only)


def _load_experts(model: Path, layer: int, proj: str) -> np.ndarray:
    """All routed experts' `proj` matrices of one layer stacked into rows (bf16 -> f32)."""
    import torch
    from safetensors import safe_open

    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    names = [k for k in index if f".layers.{layer}.mlp.experts." in k and k.endswith(f"{proj}.weight")]
    names.sort(key=lambda k: int(k.split(".experts.")[1].split(".")[0]))
    mats = []
    for k in names:
        with safe_open(model / index[k], "pt") as f:
            mats.append(f.get_tensor(k).to(torch.float32).numpy())
    return np.concatenate(mats)


def _time(fn, repeat: int) -> tuple[float, float, np.ndarray]:
    """(best cpu seconds, best wall seconds, last result) over `repeat` runs."""
    cpu, wall, out = float("inf"), float("inf"), None
    for _ in range(repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        cpu, wall = min(cpu, time.process_time() - c0), min(wall, time.perf_counter() - w0)
    return cpu, wall, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "models" / "glm5next-k256")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--rows", type=int, default=4096, help="rows of the random matrix")
    ap.add_argument("--cols", type=int, default=2048, help="columns of the random matrix")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    if not kquants_ggml.available():
        raise SystemExit("libggml-base not found: install llama-cpp-python==0.3.36 or set MIXQ_GGML_BASE_LIB")

    tensors = {}
    if (args.model / "model.safetensors.index.json").is_file():
        tensors["k256 L2 experts gate (48x256x256)"] = _load_experts(args.model, 2, "gate_proj")
    rng = np.random.default_rng(0)
    tensors[f"random {args.rows}x{args.cols}"] = rng.standard_normal((args.rows, args.cols)).astype(np.float32)

    print(f"{'tensor':36s} {'type':6s} {'imat':4s} {'mixq Mw/s':>10s} {'ggml Mw/s':>10s} {'cpu ratio':>9s}"
          f" {'wall ratio':>10s} {'equal':>5s}")
    ratios = []
    for tname, x in tensors.items():
        im = np.exp(rng.standard_normal(x.shape[1])).astype(np.float32)
        for t in args.types.split(","):
            for imx in (None, im):
                if imx is None and t in kquants.REQUIRES_IMATRIX:
                    continue  # ggml aborts without one
                # one-off table set-up (the i-quant codebooks / neighbour lists, on both sides) outside the timing
                kquants.quantize(x[:1], t, imx), kquants_ggml.ggml_quantize(x[:1], t, imx)
                c_m, w_m, a = _time(lambda: kquants.quantize(x, t, imx), args.repeat)
                c_g, w_g, b = _time(lambda: kquants_ggml.ggml_quantize(x, t, imx), args.repeat)
                mw = x.size / 1e6
                ratios.append(c_m / c_g)
                print(f"{tname:36s} {t:6s} {'yes' if imx is not None else 'no':4s} {mw / c_m:10.2f} {mw / c_g:10.2f}"
                      f" {c_m / c_g:9.2f} {w_m / w_g:10.2f} {str(np.array_equal(a, b)):>5s}", flush=True)
    r = np.array(ratios)
    print(f"mixq/ggml CPU-time ratio: median {np.median(r):.2f}, range {r.min():.2f}-{r.max():.2f} over {r.size} runs")


if __name__ == "__main__":
    main()
