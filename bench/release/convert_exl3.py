"""Measure `mixq convert` to EXL3: glm5next-mini at several bpw targets (CPU by default).

For each target: the conversion runs in its own process (`python -m mixq convert ... --json`), so its wall time and
peak RSS (ru_maxrss of that child) are its own; then `mixq verify`, the plan coverage, quantization_config.bits
against the target, and the KLD / top-1 against the BF16 model on heldout.txt (mixq.eval.evaluate).

  python bench/release/convert_exl3.py                       # mini at 4.0 and 2.0 bpw, 8 windows x 512 tokens
  python bench/release/convert_exl3.py --bpw 4.0 --windows 4 --out ../bench-work/exl3-bench --json result.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from paths import SHARED, WORK, repo_relative  # noqa: E402


def convert_child(model: Path, out: Path, bpw: float, rows: int, seq_len: int, calibration: Path,
                  device: str = "cpu", extra: tuple = ()) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.time()
    cmd = [sys.executable, "-m", "mixq", "convert", str(model), str(out), "--format", "exl3", "--bpw", str(bpw),
           "--rows", str(rows), "--seq-len", str(seq_len), "--device", device, "--calibration", str(calibration),
           "--json", *extra]
    if (out / ".mixq-job").exists():
        cmd.append("--resume")
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TQDM_DISABLE="1"))
    wall = time.time() - t
    if r.returncode != 0:
        raise SystemExit(f"convert failed ({r.returncode}):\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    res["wall_s"] = wall
    res["child_peak_rss_mib"] = max(peak, before) / 1024  # max over children so far (conversions run in order)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=SHARED / "models" / "glm5next-mini")
    ap.add_argument("--bpw", type=float, action="append", default=None)
    ap.add_argument("--out", type=Path, default=WORK / "exl3-bench")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--device", default="cpu", help="conversion and evaluation device (cpu | cuda)")
    ap.add_argument("--no-mtp", action="store_true", help="leave the NextN block out (faster)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    targets = args.bpw or [4.0, 2.0]

    from mixq.conversion.api import verify
    from mixq.planning.planner import plan_model
    from mixq.eval.api import evaluate
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.exl3_names import exl3_layout

    ck = open_checkpoint(args.model)
    rows = []
    for bpw in targets:
        out = args.out / f"{args.model.name}-{bpw}"
        if not (out / "config.json").exists():
            conv = convert_child(args.model, out, bpw, args.rows, args.seq_len, SHARED / "data" / "calibration.txt",
                                 args.device, ("--no-mtp",) if args.no_mtp else ())
        else:
            conv = {"wall_s": None, "child_peak_rss_mib": None, "note": "existing output reused"}
        rep = verify(out)
        plan = plan_model(ck, "exl3", bpw=bpw, include_mtp=not args.no_mtp)
        units = {n: u for u in exl3_layout(ck, include_mtp=not args.no_mtp) for n in u.hf_names}
        stored = set(json.loads((out / "mixq_manifest.json").read_text())["tensors"])
        missing = [t.name for t in plan.tensors
                   if not set(units[t.hf_names[0]].tensor_specs(t.bits if units[t.hf_names[0]].kind == "trellis"
                                                                else None)) <= stored]
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        ev = evaluate(args.model, [out], SHARED / "data" / "heldout.txt", ctx=args.ctx, windows=args.windows,
                      device=args.device, progress=False)
        c = ev["candidates"][0]
        rows.append({"bpw_target": bpw, "bits": qc["bits"], "bits_ok": abs(qc["bits"] - bpw) <= 0.1,
                     "verify_ok": rep["ok"], "problems": rep["problems"][:5], "planned_missing": missing[:5],
                     "bytes": rep["bytes"], "seconds": conv.get("seconds"), "wall_s": conv.get("wall_s"),
                     "peak_rss_mib": conv.get("peak_rss_mib"), "child_peak_rss_mib": conv.get("child_peak_rss_mib"),
                     "fallbacks": len(conv.get("fallbacks", [])), "kld": c["kld_mean"], "top1": c["top1"]})
        r = rows[-1]
        print(f"{args.model.name} @ {bpw}: bits {r['bits']} ({'ok' if r['bits_ok'] else 'OFF'}), "
              f"verify {'ok' if r['verify_ok'] else 'FAIL'}, {r['bytes'] / 2**20:.2f} MiB, "
              f"time {r['seconds']} s, peak RSS {r['peak_rss_mib']} MiB, KLD {r['kld']:.4f}, top-1 {r['top1']:.3f}",
              flush=True)
    if len(rows) >= 2:
        by = {r["bpw_target"]: r["kld"] for r in rows}
        if 4.0 in by and 2.0 in by:
            print(f"KLD 4.0 < KLD 2.0: {by[4.0] < by[2.0]}")
    if args.json:
        args.json.write_text(json.dumps(repo_relative(rows), indent=2))
    return 0 if all(r["verify_ok"] and r["bits_ok"] and not r["planned_missing"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
