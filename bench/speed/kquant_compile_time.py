"""Compile time of mixq's fused Triton encoder kernels, for a GPU target, without a GPU.

The fused K-quant / i-quant kernels (quant/ggml/triton_kernels/) compile on their first use on a machine (Triton
caches the result). This compiles each kernel variant the GGUF encoders launch, for the given target, through
``triton.compile`` (no device needed: Triton ships ptxas), and prints the seconds and the PTX size of each.

    python bench/speed/kquant_compile_time.py                         # sm_90 (H100/H200), every variant
    python bench/speed/kquant_compile_time.py --only qp32,q3 --json bench/results/kquant-compile-time.json
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

# a fresh cache: a kernel found in Triton's cache would take no time (set before triton is imported)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="mixq-triton-cache-")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mixq.quant.ggml.triton_kernels import search as kf  # noqa: E402
from mixq.quant.ggml.triton_kernels import descent as kd  # noqa: E402
from mixq.quant.ggml.triton_kernels import grid as kg  # noqa: E402
from mixq.quant.ggml.i_quants import numpy_iq2  # noqa: E402

# (label, the ggml types that launch it): kernel, [(argument, type)], constexprs
P32, I32 = "*fp32", "*i32"


def variants() -> dict[str, tuple]:
    qkx, qx = kf._kernels()
    _, qp, q3 = kd._kernels()
    qkx_args = [("x_ptr", P32), ("w_ptr", P32), ("num_ptr", P32), ("scale_ptr", P32), ("min_ptr", P32),
                ("L_ptr", I32), ("B", "i32")]
    qp_args = [("x_ptr", P32), ("w_ptr", P32), ("num_ptr", P32), ("scale_ptr", P32), ("L_ptr", I32), ("B", "i32")]
    q3_args = [("x_ptr", P32), ("scale_ptr", P32), ("L_ptr", I32), ("B", "i32")]
    out = {
        "qkx32 (Q4_K, Q5_K)": (qkx, qkx_args, dict(NCAND=21, NMAX=15, N=32, USE_MAD=False, LANES=kf.LANES)),
        "qkx16 (Q2_K)": (qkx, qkx_args, dict(NCAND=16, NMAX=3, N=16, USE_MAD=True, LANES=kf.LANES)),
        "qp8 (Q4_K, Q5_K with imatrix)": (qp, qp_args, dict(N=8, NP2=8, NMAX=63, EPS=1e-15, LANES=kf.LANES)),
        "qp16 (Q2_K, Q3_K with imatrix)": (qp, qp_args, dict(N=16, NP2=16, NMAX=15, EPS=1e-15, LANES=kf.LANES)),
        "qp32 (IQ2_XXS seeds)": (qp, qp_args, dict(N=32, NP2=32, NMAX=3, EPS=1e-15, LANES=kf.LANES)),
        "q3 (Q3_K)": (q3, q3_args, dict(N=16, NP2=16, NMAX=4, EPS=1e-15, LANES=kf.LANES)),
    }
    grid_args = [(n, P32) for n in ("x_ptr", "w_ptr", "wa_ptr", "base_ptr", "scale0_ptr", "num_ptr")] + \
        [(n, I32) for n in ("kmap_ptr", "nb_row_ptr", "nb_len_ptr", "nb_ptr", "gcode_ptr", "tmp_ptr", "win_ptr")] + \
        [("on_ptr", "*i8"), ("scale_ptr", P32), ("B", "i32")]
    for qtype, m, ncand in (("IQ2_XXS", 32, 13), ("IQ2_XS", 16, 19), ("IQ2_S", 16, 19), ("IQ3_XXS", 32, 31)):
        cb = numpy_iq2.codebook(qtype)
        out[f"grid {qtype}"] = (kg._kernel(), grid_args, dict(
            NCAND=ncand, M=m, GROUP=cb.group, BITS=int(cb.shifts[1]), NLEV=cb.nlev, MAXLEN=int(cb.nb.shape[1]),
            REFINE=0, ON_INIT=1, LANES=kg.LANES))
    return out


def compile_one(fn, args, consts: dict, target: GPUTarget, num_warps: int) -> tuple[float, int]:
    sig = dict(args)
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    t = time.time()
    k = triton.compile(src, target=target, options={"num_warps": num_warps, "enable_fp_fusion": False})
    return time.time() - t, len(k.asm["ptx"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 [90]")
    ap.add_argument("--only", default="", help="comma list of substrings of the variant labels")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    target = GPUTarget("cuda", a.arch, 32)
    rows = []
    for label, (fn, args, consts) in variants().items():
        if a.only and not any(s in label for s in a.only.split(",")):
            continue
        warps = 2 if label.startswith("grid") else 4
        sec, ptx = compile_one(fn, args, consts, target, warps)
        rows.append({"kernel": label, "seconds": round(sec, 1), "ptx_chars": ptx})
        print(f"{label:34s} {sec:7.1f} s   PTX {ptx / 1e3:8.0f} k chars", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"target": f"sm_{a.arch}", "triton": triton.__version__, "rows": rows},
                                     indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
