"""Wall time of a 3-member family against the single conversion of its largest member, in one run.

    python bench/release/family_cost.py                       # glm5next-mini, sizes of the Q3_K_M / Q4_K_M / Q5_K_M mixes
    python bench/release/family_cost.py --model glm5next-k256 --out bench/results/family_cost_k256.json
    python bench/release/family_cost.py --model glm5next-k256 --rounding hessian \
        --out bench/results/family_cost_k256_hessian.json
    python bench/release/family_cost.py --model glm5next-k256 --plan measured \
        --out bench/results/family_cost_k256_measured.json   # members planned from measured curves
    python bench/release/family_cost.py --format exl3 --model glm5next-k256 --device cuda \
        --out bench/results/family_cost_exl3_k256.json   # members 2.5, 3.05, 4.0 bpw

GGUF: both get the same imatrix, computed once before either is timed (its time is printed apart: the family would
compute it itself when no --imatrix is given, the single conversion never does), the same threads and
options; the single conversion runs first, so the operating system's file cache favours the family no more than
the conversion. `--plan measured`: the members are planned from measured curves (the family's `--measure kld`, which
measures them once and keeps every exact encode in its cache); the baseline is the largest member's measured plan
made alone, measurement included (`mixq.measure(..., method="kld")` into a file named as the family names its own,
then `convert --size X --measure FILE`), as for EXL3 below. Prints the ratio (target <= 1.5) and writes bench/results/family_cost.json (paths repo-relative).
The members are also checked byte-identical to the single conversion of the largest. `--rounding hessian`: both
runs round with Hessians (calibration.txt, --hessian-rows x 128 tokens, --tune-iters); the family rounds a
(tensor, type) its members share once, and tunes every member on its own.

EXL3 (--format exl3): the baseline is the measured plan of the largest member made alone, measurement included
(`mixq plan --measure --measure-out C.json`, then `mixq convert --bpw X --measure C.json`), since the family
measures its curves once too (into OUT/<model>.exl3-curves.json); both with the same --measure method, rows,
seq_len and device, the single conversion first. On cuda an untimed warm-up runs before both (--warmup quick: a
small trellis encode at every rate; full: one whole measurement): the first encode at a rate compiles its GPU
kernels, which would otherwise count against whichever runs first.
Every member is still calibrated and encoded on its own (its layers see its own quantized hidden states), so the
ratio is about (curves + every member) / (curves + the largest). Writes bench/results/family_cost_exl3.json by
default; the largest member is checked byte-identical to the single conversion (both curve files are compared
too: a plan is only as repeatable as its measurement).
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for paths.py
from paths import REPO, SHARED, repo_relative  # noqa: E402

import torch

from mixq.api import convert, imatrix, measure
from mixq.conversion.gguf.family import CURVES_SUFFIX as GGUF_CURVES_SUFFIX
from mixq.planning.sizes import parse_size
from mixq.measurement.trellis import load_curves
from mixq.formats.exl3_layout import RATES
from mixq.formats.safetensors_io import sha256_file
from mixq.planning.planner import plan_model
from mixq.quant import trellis

MIXES = ("Q3_K_M", "Q4_K_M", "Q5_K_M")
# a --size plan keeps token_embd in BF16 and output at 6 bits: on the fixtures that is more than the Q3_K_M mix's
# whole file; with token_embd at Q4_K and output at 5 bits the mixes' byte counts are reachable
STEER = {"overrides": ("embed=Q4_K",), "head_bits": 5}
EXL3_BPW = (2.5, 3.05, 4.0)  # the issue's EXL3 members


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", dest="fmt", choices=("gguf", "exl3"), default="gguf")
    ap.add_argument("--model", default="glm5next-mini", help="a fixture under ../shared/models, or a path")
    ap.add_argument("--sizes", default=None, help="GGUF: A,B,C [default: the Q3_K_M/Q4_K_M/Q5_K_M mixes' bytes]")
    ap.add_argument("--bpw", default=None, help="EXL3: x,y,z [default: 2.5,3.05,4.0]")
    ap.add_argument("--threads", type=int, default=2, help="GGUF: encoder threads")
    ap.add_argument("--rounding", choices=("exact", "hessian"), default="exact", help="GGUF: both runs' rounding")
    ap.add_argument("--plan", choices=("roles", "measured"), default="roles",
                    help="GGUF: members planned by roles, or from measured curves (--measure kld)")
    ap.add_argument("--hessian-rows", type=int, default=8, help="GGUF --rounding hessian: calibration rows of 128")
    ap.add_argument("--tune-iters", type=int, default=20, help="GGUF --rounding hessian: tuning steps per stage")
    ap.add_argument("--rows", type=int, default=None, help="GGUF: imatrix calibration rows [default: 8]; EXL3: "
                                                           "calibration rows of every conversion [default: 64]")
    ap.add_argument("--seq-len", type=int, default=None, help="EXL3: tokens per calibration row [default: 512]")
    ap.add_argument("--measure", default="trellis", choices=("trellis", "proxy"), help="EXL3: how the curves are "
                                                                                        "measured")
    ap.add_argument("--device", default=None, choices=("cuda", "cpu"),
                    help="EXL3: where both run [default: cuda when present]")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="EXL3: torch intra-op threads (1 on a CPU shared with other work) [default: torch's]")
    ap.add_argument("--warmup", choices=("quick", "full", "none"), default=None,
                    help="EXL3, untimed, so neither timed run carries the GPU kernels' first compiles: quick = one "
                         "small trellis encode at every rate, alone and stacked; full = one whole measurement "
                         "[default: quick on cuda, none on cpu]")
    ap.add_argument("--out", default=None, help="[default: bench/results/family_cost.json, "
                                                "family_cost_exl3.json for EXL3]")
    a = ap.parse_args()
    model = Path(a.model) if Path(a.model).is_dir() else SHARED / "models" / a.model
    name = "family_cost.json" if a.fmt == "gguf" else "family_cost_exl3.json"
    out = Path(a.out or REPO / "bench" / "results" / name)
    res = gguf_cost(model, a) if a.fmt == "gguf" else exl3_cost(model, a)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"written {repo_relative(str(out))}")


def gguf_cost(model: Path, a) -> dict:
    """The GGUF family against its largest member alone (the imatrix computed once, apart)."""
    rows = 8 if a.rows is None else a.rows
    measured = a.plan == "measured"
    # a measured plan measures token_embd and output like the rest (no steering, which it refuses)
    steer = STEER if a.sizes is None and not measured else {}
    sizes = ([int(s) if s.isdigit() else s for s in a.sizes.split(",")] if a.sizes
             else [plan_model(model, "gguf", qtype=q).total_bytes for q in MIXES])
    work = Path(tempfile.mkdtemp(prefix="mixq-family-cost-"))
    try:
        t = time.perf_counter()
        im = work / "calib.imatrix.gguf"
        imatrix(model, im, rows=rows, seq_len=128, device="cpu", progress=False)
        t_imatrix = time.perf_counter() - t
        hess = dict(rounding="hessian", calibration=[SHARED / "data" / "calibration.txt"], rows=a.hessian_rows,
                    seq_len=128, tune_iters=a.tune_iters) if a.rounding == "hessian" else {}
        common = dict(imatrix=im, threads=a.threads, progress=False, **steer, **hess)
        largest = max(sizes, key=lambda s: parse_size(s))
        t = time.perf_counter()
        t_measure = None
        if measured:
            curves = work / "single" / f"{model.name}{GGUF_CURVES_SUFFIX}"  # the name the receipt records
            curves.parent.mkdir()
            measure(model, "gguf", method="kld", imatrix=im, out=curves, rounding=a.rounding,
                    calibration=hess.get("calibration", ()), progress=False)
            t_measure = time.perf_counter() - t
            common_single = dict(common, measure=curves)
        else:
            common_single = common
        single = convert(model, work / "single.gguf", "gguf", size=largest, **common_single)
        t_single = time.perf_counter() - t
        t = time.perf_counter()
        fam = convert(model, work / "family", "gguf", size=sizes, **common, **({"measure": "kld"} if measured else {}))
        t_family = time.perf_counter() - t
        member = fam.members[sizes.index(largest)]
        identical = (work / "family" / member["file"]).read_bytes() == Path(single.out).read_bytes()
        res = {"model": repo_relative(str(model)), "sizes": sizes, "threads": a.threads, "rounding": a.rounding,
               **({"hessian_rows": a.hessian_rows, "tune_iters": a.tune_iters} if hess else {}),
               "plan": a.plan, **({"single_measure_seconds": round(t_measure, 2)} if measured else {}),
               "imatrix_seconds": round(t_imatrix, 2), "single_target": largest,
               "cache": {k: fam.cache[k] for k in ("hits", "writes")},
               **_figures(t_single, t_family, identical, fam.members,
                          ("file", "target_bytes", "bytes", "bpw", "within_0.1%", "note"))}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"family of {len(sizes)} ({a.plan} plans): {t_family:.1f} s; single conversion of the largest: "
          f"{t_single:.1f} s{f' (its curves {t_measure:.1f} s)' if measured else ''}; "
          f"ratio {res['ratio']:.2f} (target <= 1.5); largest member identical: {identical}; "
          f"imatrix {t_imatrix:.1f} s (not in either)")
    return res


def _figures(t_single: float, t_family: float, identical: bool, members: list[dict], keys: tuple[str, ...]) -> dict:
    """What both formats report: the two wall times, their ratio against the target, the identity check and the
    members (their `keys`)."""
    return {"single_seconds": round(t_single, 2), "family_seconds": round(t_family, 2),
            "ratio": round(t_family / t_single, 3), "target_ratio": 1.5, "largest_member_identical": identical,
            "members": [{k: m[k] for k in keys} for m in members]}


def warm_trellis(device: str) -> None:
    """One small trellis encode at every EXL3 rate, a single Linear and a stacked pair with Hessians: compiles the
    encoder's kernels for every rate before anything is timed."""
    g = torch.Generator().manual_seed(0)
    for bits in RATES:
        w = torch.randn(2, 128, 256, generator=g).to(device)
        x = torch.randn(2, 512, 256, generator=g).to(device)
        h = x.transpose(1, 2) @ x
        trellis.quantize(w[0], bits, h[0])
        trellis.quantize(w, bits, h)
    if device == "cuda":
        torch.cuda.synchronize()


def _digests(d: Path) -> dict[str, str]:
    return {str(f.relative_to(d)): sha256_file(f) for f in sorted(d.rglob("*")) if f.is_file()}


def exl3_cost(model: Path, a) -> dict:
    """The EXL3 family against its largest member alone with a measured plan, measurement included in both."""
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    bpws = [float(b) for b in a.bpw.split(",")] if a.bpw else list(EXL3_BPW)
    largest = max(bpws)
    common = dict(device=device, progress=False, **({"rows": a.rows} if a.rows else {}),
                  **({"seq_len": a.seq_len} if a.seq_len else {}))
    work = Path(tempfile.mkdtemp(prefix="mixq-family-cost-exl3-"))
    try:
        warmup = a.warmup or ("quick" if device == "cuda" else "none")
        t = time.perf_counter()
        if warmup == "quick":
            warm_trellis(device)
        elif warmup == "full":
            measure(model, "exl3", method=a.measure, out=work / "warmup.curves.json", device=device, progress=False)
        t_warm = round(time.perf_counter() - t, 2) if warmup != "none" else None
        print(f"warm-up ({warmup}): {t_warm} s", flush=True)
        t = time.perf_counter()
        curves = work / "single.curves.json"
        measure(model, "exl3", method=a.measure, out=curves, device=device, progress=False)
        t_measure = time.perf_counter() - t
        single = convert(model, work / "single", "exl3", bpw=largest, measure=curves, **common)
        t_single = time.perf_counter() - t
        print(f"single: {t_single:.1f} s (curves {t_measure:.1f} s)", flush=True)
        t = time.perf_counter()
        fam = convert(model, work / "family", "exl3", bpw=bpws,
                      **({"measure": a.measure} if a.measure != "trellis" else {}), **common)
        t_family = time.perf_counter() - t
        member = fam.members[bpws.index(largest)]
        identical = _digests(work / "family" / member["file"]) == _digests(Path(single.out))
        # the values, not the file's bytes: its "_meta" records the measurement's seconds
        same_curves = load_curves(curves) == load_curves(work / "family" / fam.curves["file"])
        res = {"model": repo_relative(str(model)), "format": "exl3", "bpw": bpws, "device": device,
               "torch_threads": torch.get_num_threads(), "measure": a.measure,
               "rows": common.get("rows"), "seq_len": common.get("seq_len"),
               "warmup": warmup, "warmup_seconds": t_warm, "single_measure_seconds": round(t_measure, 2),
               "single_target_bpw": largest, "curves_identical": same_curves,
               **_figures(t_single, t_family, identical, fam.members,
                          ("file", "target_bpw", "bytes", "bpw", "seconds"))}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"EXL3 family of {len(bpws)} on {device}: {t_family:.1f} s; the largest alone, its curves measured: "
          f"{t_single:.1f} s (curves {t_measure:.1f} s); ratio {res['ratio']:.2f} (target <= 1.5); largest member "
          f"identical: {identical} (curves identical: {same_curves})")
    return res


if __name__ == "__main__":
    main()
