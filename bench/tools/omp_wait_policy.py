"""Test times under load with OpenMP's default wait policy and with OMP_WAIT_POLICY=PASSIVE, side by side.

Each test (a pytest node id of the default suite) runs in its own `python -m pytest` process, alternating the two
policies (default, PASSIVE, default, ...) `--repeats` times, while `--busy` busy loops hold the cores (the
condition CI meets beside other jobs). Recorded per run: wall seconds, CPU seconds of the child (user + system),
the 1-minute load average before it, and pytest's exit status. tests/conftest.py sets PASSIVE for the suite.

    python bench/tools/omp_wait_policy.py --json bench/results/omp_wait_policy_under_load.json \\
        tests/conversion/test_drafter_check.py::test_distillation_learns_a_learnable_task
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_once(node: str, policy: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    else:
        env["MIXQ_TEST_OMP_DEFAULT"] = "1"  # tests/conftest.py leaves the policy unset
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node], cwd=REPO, env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"policy": policy or "default", "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "load_before": round(load, 2), "returncode": r.returncode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("nodes", nargs="+")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--busy", type=int, default=2, help="busy loops beside the tests")
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    loops = busy_loops(a.busy)
    try:
        res = {"busy_loops": a.busy, "cpus": os.cpu_count(), "repeats": a.repeats, "tests": {}}
        for node in a.nodes:
            runs = [run_once(node, pol) for _ in range(a.repeats) for pol in (None, "PASSIVE")]
            med = {p: statistics.median(r["wall_s"] for r in runs if r["policy"] == p) for p in ("default", "PASSIVE")}
            res["tests"][node] = {"runs": runs, "median_wall_s": med,
                                  "default_over_passive": round(med["default"] / med["PASSIVE"], 2)}
            print(node, med, flush=True)
            res["load_after"] = round(os.getloadavg()[0], 2)
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(res, indent=1) + "\n")  # after each test: a cut run keeps what it has
    finally:
        for p in loops:
            p.kill()


if __name__ == "__main__":
    main()
