"""Streamed routed experts on the CPU: `mixq imatrix` and `mixq eval` of k256 with the whole layer and with a
`--gpu-memory` that cuts the routed experts into groups; seconds, peak resident set and whether the outputs are the
same bytes.

On a CPU "host" and "device" are the same memory, so this measures what the grouped path costs (the group copies,
the per-pair calls), not what it saves: the saving is device memory, measured by bench/release/memory_budget.py on
a GPU. Each run is its own `mixq` process (its own peak resident set, getrusage at exit; the machine's load
average beside its seconds, since a shared machine's seconds say little).

    python bench/release/expert_groups_cpu.py --json bench/results/expert_groups_cpu_k256.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from paths import SHARED, repo_relative  # noqa: E402


# the child: mixq's CLI, its own peak resident set written to argv[1] at exit
SHIM = ("import atexit, resource, runpy, sys; out = sys.argv.pop(1); "
        "atexit.register(lambda: open(out, 'w').write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))); "
        "sys.argv[0] = 'mixq'; runpy.run_module('mixq', run_name='__main__')")


def run(cmd: list[str], rss_file: Path) -> dict:
    """A `mixq` child: seconds, its peak resident set (MiB), exit status and its stderr's memory line."""
    load = os.getloadavg()[0]  # the machine may be shared: its load beside the seconds
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", SHIM, str(rss_file), *cmd], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    line = next((ln for ln in p.stderr.splitlines() if ": memory: " in ln), None)
    rss = int(rss_file.read_text()) / 1024 if rss_file.exists() else None
    return {"rc": p.returncode, "seconds": round(seconds, 2), "load_avg_1min": load, "peak_rss_mib": rss, "memory_line": line,
            "stdout": p.stdout[-100000:], "stderr_tail": p.stderr[-1000:] if p.returncode else None}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHARED / "models" / "glm5next-k256"))
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--group", type=int, default=2, help="routed experts per group the budget is chosen for")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.runtime import memory_budget as mb
    import torch

    shapes = mb.checkpoint_shapes(open_checkpoint(args.model))
    whole = mb.imatrix_estimate(mb.MemoryBudget(torch.device("cpu"), 2**50, True), shapes, rows=args.rows,
                                seq_len=args.seq_len).stage("calibration")
    budget = whole.fixed + args.group * whole.per_piece + 1
    cal = str(SHARED / "data" / "calibration.txt")
    res: dict = {"model": repo_relative(Path(args.model)), "rows": args.rows, "seq_len": args.seq_len,
                 "experts": shapes.experts, "group": args.group, "budget_bytes": budget,
                 "whole_calibration_bytes": whole.need, "threads": torch.get_num_threads(), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        digests = {}
        for tag, extra in (("whole", []), ("grouped", ["--gpu-memory", str(budget)])):
            out = Path(tmp) / f"{tag}.gguf"
            r = run(["imatrix", args.model, str(out), "--calibration", cal, "--rows", str(args.rows),
                     "--seq-len", str(args.seq_len), "--device", "cpu", "--json", *extra], Path(tmp) / f"{tag}.rss")
            if r["rc"] == 0:
                d = json.loads(r.pop("stdout"))
                r["calibration_piece"] = d["memory"]["stages"][0]["piece"]
                digests[tag] = hashlib.sha256(out.read_bytes()).hexdigest()
            res["runs"][f"imatrix_{tag}"] = r
        res["imatrix_identical"] = len(set(digests.values())) == 1 and len(digests) == 2
    Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
    return res


if __name__ == "__main__":
    main()
