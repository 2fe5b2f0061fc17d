"""Check mixq's EXL3 trellis decoder against exllamav3 1.6.5's own CUDA reconstruction (needs a GPU).

    MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 python bench/engines/exl3_decode_check.py --out trellis_exl3_decoded.pt

For a few shapes and every K / codebook: quantize with mixq, feed `.tensors()` to exllamav3's `reconstruct`
(rotated basis, must match `QuantizedLinear.rotated()` bit for bit) and `reconstruct_had_slice` (original basis,
compared with `dequantize()`), and save a few cases as CI test vectors (tests/data/trellis_exl3_decoded.pt).
exllamav3's package __init__ pulls in its generator stack; only its extension loader is imported here.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import types
from pathlib import Path

import torch

from mixq.quant import trellis

CASES = [(k, "mul1") for k in (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)] + \
        [(k, c) for c in ("3inst", "mcg") for k in range(1, 9)]
SHAPES = [(128, 128), (300, 200)]  # HF (out, in); the second is padded to (384, 256)
SAVE = {(2, "mul1", (300, 200)), (2.5, "mul1", (128, 128)), (3, "3inst", (128, 128)), (4, "mcg", (300, 200)),
        (6, "mul1", (128, 128))}


def load_ext():
    """Import exllamav3.ext without running exllamav3/__init__.py (JIT-builds the CUDA extension)."""
    spec = importlib.util.find_spec("exllamav3")
    if spec is None:
        raise SystemExit("exllamav3 is not installed")
    root = Path(spec.origin).parent
    pkg = types.ModuleType("exllamav3")
    pkg.__path__ = [str(root)]
    sys.modules["exllamav3"] = pkg
    from exllamav3.ext import exllamav3_ext  # noqa: E402
    return exllamav3_ext


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="save selected cases as test vectors here")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()
    ext = load_ext()
    print(f"exllamav3 extension ready in {time.time() - t0:.0f}s", flush=True)
    if args.build_only:
        return
    dev = torch.device("cuda")
    rows, saved = [], []
    g = torch.Generator().manual_seed(5)
    for shape in SHAPES:
        w = torch.randn(*shape, generator=g).to(dev)
        for bits, codebook in CASES:
            q = trellis.quantize(w, bits, codebook=codebook, seed=2)
            t = {k: v.to(dev) for k, v in q.tensors().items()}
            tk, tn, _ = t["trellis"].shape
            inner = torch.empty(16 * tk, 16 * tn, dtype=torch.half, device=dev)
            ext.reconstruct(inner, t["trellis"], float(bits), codebook == "mcg", codebook == "mul1")
            ours_inner = q.rotated().half()
            mism = int((inner.view(torch.int16) != ours_inner.view(torch.int16)).sum())
            full = torch.empty_like(inner)
            ext.reconstruct_had_slice(full, t["trellis"], t["suh"], t["svh"], float(bits), codebook == "mcg",
                                      codebook == "mul1", 0)
            ours = q.dequantize().t()
            ref = full.float()[: ours.shape[0], : ours.shape[1]]
            rel = float((ours - ref).abs().max() / ref.abs().max())
            rows.append({"shape": list(shape), "bits": bits, "codebook": codebook, "inner_mismatches": mism,
                         "full_max_rel_err": rel})
            print(f"  {shape} K={bits} {codebook}: rotated-basis mismatches={mism}/{inner.numel()}  "
                  f"full max rel err={rel:.2e}", flush=True)
            if (bits, codebook, shape) in SAVE:
                saved.append({"name": f"{codebook}_K{bits}_{shape[0]}x{shape[1]}", "shape": shape,
                              "tensors": {k: v.cpu() for k, v in q.tensors().items()},
                              "exl3": full.cpu(), "exl3_rotated": inner.cpu()})
    ok = all(r["inner_mismatches"] == 0 and r["full_max_rel_err"] < 2e-3 for r in rows)
    print("ALL MATCH" if ok else "MISMATCHES FOUND", flush=True)
    if args.out:
        torch.save(saved, args.out)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
