"""CPU seconds of test files, before and after a change to them: the question of issue 60 (the default suite under
15 minutes on CI's 2 cores).

On a machine that others share, wall time says more about them than about the tests; the CPU seconds of the
pytest process and of every child it waited for (subprocesses, forked encoder workers) do not. Two steps:

    # one run per state of the tests, each writing per-test CPU and wall seconds (a pytest plugin, this module)
    PYTHONPATH=bench/tools:.. python bench/tools/suite_time.py measure --tsv before.tsv -- tests/x.py tests/y.py
    # per file: the tests, the CPU seconds of both runs, what changed (--notes JSON {file: text}), the total
    python bench/tools/suite_time.py summarize --before before.tsv --after after.tsv --notes notes.json \\
        --json bench/results/suite_time_cut.json

Run the states one after another from the same place (a copy of the old tests against the same mixq), under
the same `nice`. Only the `slow`-less default tests run (the pytest configuration's own -m).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

_TSV_ENV = "SUITE_TIME_TSV"


def _cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


try:
    import pytest
except ImportError:  # the summary needs no pytest
    pytest = None

if pytest is not None:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """Per test (setup, call and teardown, so a module fixture counts where it is built): CPU and wall."""
        c0, t0 = _cpu(), time.time()
        yield
        path = os.environ.get(_TSV_ENV)
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{_cpu() - c0:.2f}\t{time.time() - t0:.2f}\t{item.nodeid}\n")


def read_tsv(path: Path) -> dict[str, float]:
    """{test id: CPU seconds} of a measure run (a test run twice keeps its last figure)."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        cpu, _wall, test = line.split("\t")
        out[test] = float(cpu)
    return out


def by_file(cpu: dict[str, float]) -> dict[str, dict]:
    """{file: tests, CPU seconds}. A line `FILE::* (N tests ...)` is a whole pytest run of FILE, timed from outside
    (its start and collection included): the way to count a file whose tests hand work to a process that pytest
    waits for only at its exit, as the interpreter server of tests/triton_helpers.py."""
    files: dict[str, dict] = defaultdict(lambda: {"tests": 0, "cpu_s": 0.0})
    for test, s in cpu.items():
        name, _, rest = test.partition("::")
        whole = re.match(r"\* \((\d+) tests", rest)
        f = files[name]
        f["tests"] += int(whole.group(1)) if whole else 1
        f["cpu_s"] += s
    return files


def summarize(before: dict[str, float], after: dict[str, float], notes: dict[str, str]) -> dict:
    """Per file: default tests and CPU seconds in each run, the saving, what changed; and the totals."""
    b, a = by_file(before), by_file(after)
    rows = {}
    for name in sorted(set(b) | set(a)):
        rb, ra = b.get(name, {"tests": 0, "cpu_s": 0.0}), a.get(name, {"tests": 0, "cpu_s": 0.0})
        rows[name] = {"tests_before": rb["tests"], "tests_after": ra["tests"],
                      "cpu_s_before": round(rb["cpu_s"], 2), "cpu_s_after": round(ra["cpu_s"], 2),
                      "cpu_s_saved": round(rb["cpu_s"] - ra["cpu_s"], 2), "changed": notes.get(name, "")}
    total_b = sum(r["cpu_s_before"] for r in rows.values())
    total_a = sum(r["cpu_s_after"] for r in rows.values())
    return {"files": rows, "cpu_s_before": round(total_b, 2), "cpu_s_after": round(total_a, 2),
            "cpu_s_saved": round(total_b - total_a, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="run pytest on test files, appending per-test CPU/wall seconds to --tsv")
    m.add_argument("--tsv", type=Path, required=True)
    m.add_argument("pytest_args", nargs="+")
    s = sub.add_parser("summarize", help="per-file CPU seconds of two measure runs, as JSON")
    s.add_argument("--before", type=Path, required=True)
    s.add_argument("--after", type=Path, required=True)
    s.add_argument("--notes", type=Path, help="JSON {test file: what changed}")
    s.add_argument("--meta", type=Path, help="JSON of fields to keep beside the figures (machine, commits, ...)")
    s.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "measure":
        env = dict(os.environ, **{_TSV_ENV: str(args.tsv.resolve())})
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "suite_time", *args.pytest_args]
        return subprocess.run(cmd, env=env).returncode
    notes = json.loads(args.notes.read_text()) if args.notes else {}
    res = {**(json.loads(args.meta.read_text()) if args.meta else {}),
           **summarize(read_tsv(args.before), read_tsv(args.after), notes)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1) + "\n")
    print(f"{res['cpu_s_before']:.1f} -> {res['cpu_s_after']:.1f} CPU s ({res['cpu_s_saved']:.1f} saved)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
