"""Wall time of a 3-member GGUF family against the single conversion of its largest member, in one run.

    python bench/family_cost.py                       # glm5next-mini, sizes of the Q3_K_M / Q4_K_M / Q5_K_M mixes
    python bench/family_cost.py --model glm5next-k256 --out bench/results/family_cost_k256.json

Both get the same imatrix, computed once before either is timed (its time is printed apart: the family would
compute it itself when no --imatrix is given, the single conversion never does), the same threads and
options; the single conversion runs first, so the operating system's file cache favours the family no more than
the conversion. Prints the ratio (target <= 1.5) and writes bench/results/family_cost.json (paths repo-relative).
The members are also checked byte-identical to the single conversion of the largest.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from paths import REPO, SHARED, repo_relative

from mixq.api import convert, imatrix
from mixq.planning.planner import plan_model

MIXES = ("Q3_K_M", "Q4_K_M", "Q5_K_M")
# a --size plan keeps token_embd in BF16 and output at 6 bits: on the fixtures that is more than the Q3_K_M mix's
# whole file; with token_embd at Q4_K and output at 5 bits the mixes' byte counts are reachable
STEER = {"overrides": ("embed=Q4_K",), "head_bits": 5}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="glm5next-mini", help="a fixture under ../shared/models, or a path")
    ap.add_argument("--sizes", default=None, help="A,B,C [default: the Q3_K_M/Q4_K_M/Q5_K_M mixes' bytes]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8, help="imatrix calibration rows")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "family_cost.json"))
    a = ap.parse_args()
    model = Path(a.model) if Path(a.model).is_dir() else SHARED / "models" / a.model
    steer = STEER if a.sizes is None else {}
    sizes = ([int(s) if s.isdigit() else s for s in a.sizes.split(",")] if a.sizes
             else [plan_model(model, "gguf", qtype=q).total_bytes for q in MIXES])
    work = Path(tempfile.mkdtemp(prefix="mixq-family-cost-"))
    try:
        t = time.perf_counter()
        im = work / "calib.imatrix.gguf"
        imatrix(model, im, rows=a.rows, seq_len=128, device="cpu", progress=False)
        t_imatrix = time.perf_counter() - t
        common = dict(imatrix=im, threads=a.threads, progress=False, **steer)
        largest = max(sizes, key=lambda s: plan_model(model, "gguf", size=s, **steer).total_bytes)
        t = time.perf_counter()
        single = convert(model, work / "single.gguf", "gguf", size=largest, **common)
        t_single = time.perf_counter() - t
        t = time.perf_counter()
        fam = convert(model, work / "family", "gguf", size=sizes, **common)
        t_family = time.perf_counter() - t
        member = fam.members[sizes.index(largest)]
        identical = (work / "family" / member["file"]).read_bytes() == Path(single.out).read_bytes()
        res = {"model": repo_relative(str(model)), "sizes": sizes, "threads": a.threads,
               "imatrix_seconds": round(t_imatrix, 2), "single_seconds": round(t_single, 2),
               "single_target": largest, "family_seconds": round(t_family, 2),
               "ratio": round(t_family / t_single, 3), "target_ratio": 1.5,
               "largest_member_identical": identical, "cache": {k: fam.cache[k] for k in ("hits", "writes")},
               "members": [{k: m[k] for k in ("file", "target_bytes", "bytes", "bpw", "within_0.1%", "note")}
                           for m in fam.members]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"family of {len(sizes)}: {t_family:.1f} s; single conversion of the largest: {t_single:.1f} s; "
          f"ratio {res['ratio']:.2f} (target <= 1.5); largest member identical: {identical}; "
          f"imatrix {t_imatrix:.1f} s (not in either)")
    print(f"written {repo_relative(str(out))}")


if __name__ == "__main__":
    main()
