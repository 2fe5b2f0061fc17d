"""Which CPU computations of a conversion follow torch's intra-op thread count: each run at 1 and at 2 threads.

- a whole-tensor float32 mean (ATen splits a sum of 32768 elements or more over its threads) against a max;
- Σxᵀx of a narrow input over many tokens, as `HessianAccumulator` forms it, with and without its one-thread pin;
- F.linear at GLM-5.3-Flash's widths over one calibration batch (4 rows x 512 tokens), in this process and in
  one started with MKL's strict conditional-numerical-reproducibility mode (``MKL_CBWR=<branch>,STRICT``, read when
  MKL starts), and whether that mode changes the one-thread results;
- the calibration walk of glm5next-k256 (16 rows x 256 tokens in one batch, NextN included): how many Σxᵀx and
  hidden streams differ between 1 and 2 threads, with the accumulator's pin and without it.

    PYTHONPATH=.. python bench/tools/thread_determinism.py --json bench/results/thread_determinism_cpu.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from paths import SHARED  # noqa: E402

from mixq.quant import hessian as hessian_mod  # noqa: E402

# (tokens, in, out): the router, the routed experts' gate_up and down, the indexer's head weights, q_a, kv_a
LINEAR_SHAPES = {"router": (2048, 4096, 288), "expert gate_up": (2048, 4096, 4096), "expert down": (2048, 2048, 4096),
                 "indexer weights_proj": (2048, 4096, 32), "q_a_proj": (2048, 4096, 1536),
                 "kv_a_proj": (2048, 4096, 576)}
XTX_SHAPES = [(1024, 64), (2048, 64), (2048, 128), (2048, 256), (8192, 128), (2048, 1024)]


def at_threads(n: int, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


def whole_tensor_mean() -> dict:
    w = torch.randn(8192, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    m1, m2 = (at_threads(n, lambda: float(w.abs().mean())) for n in (1, 2))
    a1, a2 = (at_threads(n, lambda: float(w.abs().amax())) for n in (1, 2))
    return {"shape": [8192, 128], "mean_1_thread": m1, "mean_2_threads": m2, "mean_same": m1 == m2,
            "amax_same": a1 == a2}


def xtx_rows() -> list[dict]:
    rows = []
    for t, d in XTX_SHAPES:
        x = torch.randn(t, d, generator=torch.Generator().manual_seed(t + d))

        def raw():
            return torch.zeros(d, d).addmm_(x.T, x)

        def pinned():
            acc = hessian_mod.HessianAccumulator(d)
            acc.add(x)
            return acc.xtx

        r1, r2 = at_threads(1, raw), at_threads(2, raw)
        p1, p2 = at_threads(1, pinned), at_threads(2, pinned)
        rows.append({"tokens": t, "width": d, "addmm_same": torch.equal(r1, r2),
                     "addmm_max_abs_diff": float((r1 - r2).abs().max()),
                     "accumulator_same": torch.equal(p1, p2), "accumulator_equals_addmm_1_thread": torch.equal(p1, r1)})
    return rows


def linear_results() -> dict:
    out = {}
    for name, (t, k, n) in LINEAR_SHAPES.items():
        g = torch.Generator().manual_seed(k + n)
        x, w = torch.randn(t, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5
        y1, y2 = (at_threads(c, lambda: F.linear(x, w)) for c in (1, 2))
        out[name] = {"tokens": t, "in": k, "out": n, "same": torch.equal(y1, y2),
                     "one_thread_sha": _sha(y1)}
    return out


def _sha(t: torch.Tensor) -> str:
    import hashlib
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


def linear_under_strict_cnr(branch: str) -> dict | None:
    env = dict(os.environ, MKL_CBWR=f"{branch},STRICT")
    r = subprocess.run([sys.executable, __file__, "--linear-only"], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return None
    return json.loads(r.stdout)


def calibration_walk(pinned: bool, threads: int) -> dict[str, torch.Tensor]:
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.runtime.calibration import LayerCalibrator

    ck = open_checkpoint(SHARED / "models" / "glm5next-k256")
    ids = torch.randint(0, 8192, (16, 256), generator=torch.Generator().manual_seed(4))
    saved = hessian_mod.one_cpu_thread
    if not pinned:
        hessian_mod.one_cpu_thread = lambda device: contextlib.nullcontext()

    def walk():
        cal = LayerCalibrator(ck, ids, batch_rows=16, nextn=True)
        out = {}
        for st in cal.stages():
            out.update({f"xtx {n}": a.xtx.clone() for n, a in st.stats.items()})
            if st.layer is not None and cal.hidden is not None:
                out[f"hidden {st.layer}"] = cal.hidden.clone()
        return out

    try:
        return at_threads(threads, walk)
    finally:
        hessian_mod.one_cpu_thread = saved


def calibration() -> dict:
    res = {"model": "glm5next-k256", "rows": 16, "seq_len": 256, "batch_rows": 16}
    walks = {}
    for pinned in (False, True):
        a, b = calibration_walk(pinned, 1), calibration_walk(pinned, 2)
        walks[pinned] = a
        xtx = [n for n in a if n.startswith("xtx")]
        hid = [n for n in a if n.startswith("hidden")]
        diff = [n for n in xtx if not torch.equal(a[n], b[n])]
        rel = max((float((a[n] - b[n]).abs().max() / a[n].abs().max()) for n in diff), default=0.0)
        res["pinned" if pinned else "unpinned"] = {
            "xtx": len(xtx), "xtx_differing": len(diff), "max_rel_diff": rel,
            "element_share_differing": (sum(int((a[n] != b[n]).sum()) for n in diff)
                                        / max(1, sum(a[n].numel() for n in diff))),
            "hidden_streams": len(hid), "hidden_differing": sum(not torch.equal(a[n], b[n]) for n in hid)}
    res["pinned_equals_unpinned_at_1_thread"] = all(torch.equal(walks[True][n], walks[False][n]) for n in walks[True])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="Write the results here.")
    ap.add_argument("--linear-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cnr-branch", default="AVX2", help="MKL_CBWR branch of the strict-mode run (AVX2, AVX512).")
    a = ap.parse_args()
    if a.linear_only:
        print(json.dumps(linear_results()))
        return
    res = {"torch": torch.__version__, "machine": platform.machine(), "blas": torch.backends.mkl.is_available()
           and "mkl" or "other", "whole_tensor_mean": whole_tensor_mean(), "xtx": xtx_rows(),
           "linear": linear_results()}
    strict = linear_under_strict_cnr(a.cnr_branch)
    if strict is not None:
        res["linear_mkl_strict_cnr"] = {"branch": a.cnr_branch, "same_at_1_and_2_threads":
                                        {k: v["same"] for k, v in strict.items()},
                                        "one_thread_result_unchanged":
                                        {k: v["one_thread_sha"] == res["linear"][k]["one_thread_sha"]
                                         for k, v in strict.items()}}
    res["calibration"] = calibration()
    text = json.dumps(res, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
