"""Hang check of the GGUF encoder pool's error path: run the worker-error tests many times under CPU load.

An error inside a `--threads N` conversion aborts the worker pool; a shutdown that can wait for ever shows up as
a test run that never ends. This runs the tests that take that path RUNS times, each in a fresh pytest process
with a wall-clock limit, while BUSY busy-loop processes compete for the cores, and counts passes, failures and
hangs (a run killed at the limit).

    python bench/tools/gguf_abort_loop.py --runs 30 --busy 2 --json bench/results/gguf_abort_loop.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = ["tests/conversion/test_gguf_pipeline.py::test_non_finite_weight_is_one_line_naming_the_tensor",
         "tests/conversion/test_gguf_threads.py::test_worker_error_is_the_same_one_line_and_leaves_no_file"]


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_once(limit: float) -> tuple[str, float]:
    """('pass' | 'fail' | 'hang', seconds) of one pytest process running TESTS (pytest-timeout off: the limit
    here is the judge, and a hang must not be turned into a failure)."""
    t = time.time()
    p = subprocess.Popen([sys.executable, "-m", "pytest", *TESTS, "-q", "-p", "no:cacheprovider", "-o", "timeout=0"],
                         cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        rc = p.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # pytest and its encoder workers
        p.wait()
        return "hang", time.time() - t
    return ("pass" if rc == 0 else "fail"), time.time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the tests")
    ap.add_argument("--limit", type=float, default=300.0, help="seconds after which a run counts as hung")
    ap.add_argument("--json", type=Path, help="write the counts here")
    a = ap.parse_args()
    busy = _busy(a.busy)
    runs = []
    try:
        for i in range(a.runs):
            outcome, secs = run_once(a.limit)
            runs.append({"outcome": outcome, "seconds": round(secs, 1)})
            print(f"run {i + 1}/{a.runs}: {outcome} in {secs:.1f} s", file=sys.stderr, flush=True)
    finally:
        for b in busy:
            b.kill()
            b.wait()
    secs = [r["seconds"] for r in runs]
    res = {"tests": TESTS, "runs": len(runs), "busy_processes": a.busy, "limit_s": a.limit,
           "passed": sum(r["outcome"] == "pass" for r in runs), "failed": sum(r["outcome"] == "fail" for r in runs),
           "hangs": sum(r["outcome"] == "hang" for r in runs),
           "seconds": {"min": min(secs), "median": statistics.median(secs), "max": max(secs)} if secs else {},
           "cpus": os.cpu_count(), "python": platform.python_version()}
    text = json.dumps(res, indent=2) + "\n"
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
