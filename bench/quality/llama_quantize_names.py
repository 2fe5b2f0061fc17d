"""Every llama-quantize type name as `mixq convert --type`: is mixq's `--rounding exact` file llama-quantize's, byte for
byte, on k256?

    PYTHONPATH=.. python bench/quality/llama_quantize_names.py --json bench/results/llama_quantize_names_k256.json
    PYTHONPATH=.. python bench/quality/llama_quantize_names.py -k "IQ2_XXS or Q4_0" --json /tmp/some.json
    PYTHONPATH=.. python bench/quality/llama_quantize_names.py --rows-from ROWS.jsonl --json ...   # a stopped run

Runs the slow tests of tests/conversion/test_llama_quantize_names.py (one case per mix, with mixq's imatrix; the
mixes whose rules change with an imatrix also without one): mixq's file against `llama_model_quantize`
(llama-cpp-python 0.3.36) on mixq's own BF16 GGUF of k256, every tensor's ggml type and bytes and the file type.
The JSON holds one row per case (tensors, tensors that differ, the ggml types the file holds, whether the NextN
block was in: left out where the imatrix has no entries for it and the mix needs them), each test's outcome, and
the cases not run (`--rows-from`: the rows a run stopped early had recorded, its MIXQ_LQ_NAMES_RESULTS file).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from paths import REPO, SHARED, repo_relative  # noqa: E402

TESTS = "tests/conversion/test_llama_quantize_names.py"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="result file")
    ap.add_argument("-k", default=None, help="pytest -k expression: a subset of the cases")
    ap.add_argument("--rows-from", default=None, help="rows a stopped run recorded: assemble them, run nothing")
    a = ap.parse_args(argv)
    if a.rows_from:
        rows = [json.loads(x) for x in Path(a.rows_from).read_text().splitlines()]
        return _write(a.json, rows, {}, rc=None, seconds=None)
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = Path(tmp) / "rows.jsonl"
        junit = Path(tmp) / "junit.xml"
        env = {**os.environ, "MIXQ_LQ_NAMES_RESULTS": str(rows_file), "MIXQ_SHARED": str(SHARED)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow", TESTS,
               f"--junitxml={junit}"] + (["-k", a.k] if a.k else [])
        t0 = time.time()
        rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
        seconds = round(time.time() - t0, 1)
        rows = [json.loads(x) for x in rows_file.read_text().splitlines()] if rows_file.exists() else []
        outcomes = _outcomes(junit)
    return _write(a.json, rows, outcomes, rc=rc, seconds=seconds)


def _write(path: str, rows: list[dict], outcomes: dict[str, str], *, rc, seconds) -> int:
    """The result file: the rows, every case's outcome (pytest's report, else the row's: 0 tensors differ and the
    same file type), the cases with no row, and the names that refuse (no encoder yet)."""
    import llama_cpp

    from mixq.planning import gguf_mix as gm

    by_case = {f"test_exact_file_equals_llama_quantize[{r['mix']}-{'imx' if r['imatrix'] else 'plain'}]": r
               for r in rows}
    for case, r in by_case.items():
        ok = r["differ"] == 0 and r["file_type"][0] == r["file_type"][1]
        outcomes.setdefault(case, "passed" if ok else "failed")
    writable = [m for m in gm.MIX_NAMES if gm.has_encoder(gm.MIX_DEFAULT[m])]
    res = {"question": "is mixq's --rounding exact file llama-quantize's, byte for byte, for every type name?",
           "model": "glm5next-k256", "llama_cpp_python": llama_cpp.__version__, "tests": TESTS, "pytest_rc": rc,
           "seconds": seconds, "cases": len(outcomes), "passed": sum(v == "passed" for v in outcomes.values()),
           "tensors_differ_total": sum(r["differ"] for r in rows),
           "not_run": [m for m in writable if not any(r["mix"] == m for r in rows)],
           "refused_not_implemented": [m for m in gm.MIX_NAMES if m not in writable],
           "outcomes": outcomes, "rows": rows}
    Path(path).write_text(json.dumps(repo_relative(res), indent=1) + "\n")
    print(f"{res['passed']}/{res['cases']} cases passed, {res['tensors_differ_total']} tensors differ in all; "
          f"not run: {res['not_run']}")
    return 0 if rc is None else rc


def _outcomes(junit: Path) -> dict[str, str]:
    import xml.etree.ElementTree as ET

    if not junit.exists():
        return {}
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kids = {c.tag for c in case}
        out[case.get("name")] = ("failed" if kids & {"failure", "error"} else "skipped" if "skipped" in kids
                                 else "passed")
    return out


if __name__ == "__main__":
    sys.exit(main())
