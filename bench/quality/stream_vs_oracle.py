"""`--measure stream` against its oracle `--measure kld`: do the two rank the budgeted units alike?

    python bench/quality/stream_vs_oracle.py [--pairs mini:exl3,k256:gguf,...] [--device cpu]

For each (model, format) both measurements run through the public API (`mixq.measure(model, fmt, method=...)`),
each in a process of its own so that its seconds and peak RSS are its own. A unit's cost is its curve at one
reference point, the same for both measurements: EXL3 at `EXL3_REF` bits (the rate whose error the oracle
perturbs with, `measurement.kld.REF_BITS`), GGUF at the curve's ladder point nearest `GGUF_REF` bpw (the oracle's
reference type). The result file holds, per pair, the Spearman rank correlation of the two sets of costs over
the units both measured, the number of units, each measurement's seconds and peak RSS. The oracle curves are
also saved under tests/data/stream_oracle/ (the default suite checks stream against them without rerunning
the oracle); the stream curves beside them, for the record.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]
from paths import REPO, SHARED, repo_relative  # noqa: E402

RESULT = REPO / "bench" / "results" / "stream_vs_oracle.json"
CURVES = REPO / "tests" / "data" / "stream_oracle"
MODELS = {"mini": "glm5next-mini", "k256": "glm5next-k256"}
PAIRS = ("k256:gguf", "mini:exl3", "mini:gguf", "k256:exl3")
EXL3_REF = 3.0
GGUF_REF = 3.5


def unit_costs(curves: dict, fmt: str) -> dict[str, float]:
    """Each unit's cost: its curve at EXL3_REF bits (EXL3) or at its ladder point nearest GGUF_REF bpw (GGUF)."""
    out = {}
    for k, c in curves.items():
        if k.startswith("_"):
            continue
        c = {float(b): float(v) for b, v in c.items()}
        ref = EXL3_REF if fmt == "exl3" else min(c, key=lambda b: (abs(b - GGUF_REF), b))
        out[k] = c[ref]
    return out


def spearman(a: dict[str, float], b: dict[str, float]) -> tuple[float, int]:
    """Spearman's rho of two cost maps over their common units, and the number of those units."""
    from scipy.stats import spearmanr

    keys = sorted(set(a) & set(b))
    return float(spearmanr([a[k] for k in keys], [b[k] for k in keys]).statistic), len(keys)


def curves_path(model: str, fmt: str, method: str) -> Path:
    return CURVES / f"{model}_{fmt}_{method}.json"


def measure_one(model: str, fmt: str, method: str, device: str | None) -> dict:
    """One measurement in this process: the curves saved, {seconds, peak_rss_mib}."""
    import mixq

    out = curves_path(model, fmt, method)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    mixq.measure(SHARED / "models" / MODELS[model], fmt, method=method, out=out, overwrite=True, device=device,
                 calibration=[SHARED / "data" / "calibration.txt"], progress=False)
    secs = time.time() - t0
    return {"seconds": round(secs, 1), "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def sensitivity_check(model: str, rows: int, seq_len: int) -> dict:
    """The streamed sensitivity alone against the saved EXL3 oracle: its prediction of what the oracle measures at
    EXL3_REF bits (i.i.d. noise of the trellis's error on one unit, ½·σ²·the sequence Fisher's trace summed over
    the unit's matrices) ranked against the oracle's curve there; units the backward cannot reach left out."""
    import torch

    from mixq.formats.checkpoint import open_checkpoint
    from mixq.measurement import kld as oracle
    from mixq.measurement import streaming as st
    from mixq.measurement.trellis import budget_units

    ck = open_checkpoint(SHARED / "models" / MODELS[model])
    t0, c0 = time.time(), time.process_time()
    sens = st.stream_sensitivity(ck, rows=rows, seq_len=seq_len, progress=False)
    secs, cpu = time.time() - t0, time.process_time() - c0
    pred = {}
    for key, us in budget_units(ck).items():
        names = [n for u in us for n in u.hf_names]
        if all(n in sens.noise for n in names):
            pred[key] = sum(0.5 * oracle.TRELLIS_D * 2.0 ** (-2 * EXL3_REF)
                            * float(ck.get(n, dtype=torch.float32).square().mean()) * sens.noise[n] for n in names)
    orc = unit_costs(load(curves_path(model, "exl3", "kld")), "exl3")
    rho, n = spearman(pred, orc)
    return {"spearman": round(rho, 4), "units": n, "oracle_units": len(orc), "rows": rows, "seq_len": seq_len,
            "seconds": round(secs, 1), "cpu_seconds": round(cpu, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "predicted_over_oracle": {k: round(pred[k] / orc[k], 3) for k in sorted(set(pred) & set(orc))},
            "oracle_curves": curves_path(model, "exl3", "kld")}


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", default=",".join(PAIRS), help="MODEL:FORMAT,... (models: mini, k256)")
    ap.add_argument("--methods", default="kld,stream")
    ap.add_argument("--device", default=None)
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "FORMAT", "METHOD"), help=argparse.SUPPRESS)
    ap.add_argument("--reuse", action="store_true", help="keep a method's saved curves and timing when present")
    ap.add_argument("--sensitivity", metavar="MODEL", help="only the streamed sensitivity against MODEL's saved EXL3 "
                    "oracle (2 x 64 calibration tokens, as the default test)")
    a = ap.parse_args()
    if a.sensitivity:
        row = sensitivity_check(a.sensitivity, 2, 64)
        res = load(RESULT)
        res[f"{a.sensitivity}_exl3_sensitivity"] = row
        RESULT.write_text(json.dumps(repo_relative(res), indent=1) + "\n")
        print(row)
        return
    if a.one:
        print("RESULT " + json.dumps(measure_one(*a.one, a.device)))
        return
    res = load(RESULT)
    for pair in a.pairs.split(","):
        model, fmt = pair.split(":")
        row = res.setdefault(f"{model}_{fmt}", {"model": MODELS[model], "format": fmt})
        for method in a.methods.split(","):
            if a.reuse and method in row and curves_path(model, fmt, method).is_file():
                continue
            cmd = [sys.executable, __file__, "--one", model, fmt, method] + (["--device", a.device] if a.device else [])
            p = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode != 0 or not line:
                sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
                row[method] = {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
            else:
                row[method] = json.loads(line[0][7:])
                row[method]["curves"] = curves_path(model, fmt, method)
            print(pair, method, row[method], flush=True)
            _summarise(row, model, fmt)
            res = load(RESULT)  # other pairs may run beside this one: only this pair's row is replaced
            res[f"{model}_{fmt}"] = row
            RESULT.write_text(json.dumps(repo_relative(res), indent=1) + "\n")


def _summarise(row: dict, model: str, fmt: str) -> None:
    """Spearman and unit count of a pair once both its curve files exist."""
    o, s = (curves_path(model, fmt, m) for m in ("kld", "stream"))
    if o.is_file() and s.is_file():
        rho, n = spearman(unit_costs(load(o), fmt), unit_costs(load(s), fmt))
        row.update(spearman=round(rho, 4), units=n,
                   cost=f"curve at {EXL3_REF} bits" if fmt == "exl3" else f"curve at the ladder bpw nearest {GGUF_REF}")


if __name__ == "__main__":
    main()
