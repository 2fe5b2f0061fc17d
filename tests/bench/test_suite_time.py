"""bench/tools/suite_time.py: per-file CPU seconds of two runs of the same tests, and the saving."""
from __future__ import annotations

import json

from module_loader import BENCH, load_module

st = load_module("suite_time_under_test", BENCH / "tools" / "suite_time.py")


def test_summary_adds_per_file_and_in_total(tmp_path):
    before, after = tmp_path / "b.tsv", tmp_path / "a.tsv"
    before.write_text("10.00\t12.0\ttests/x.py::a\n2.50\t3.0\ttests/x.py::b[p]\n4.00\t4.1\ttests/y.py::c\n")
    after.write_text("3.00\t9.0\ttests/x.py::a\n0.50\t0.6\ttests/x.py::b[p]\n4.25\t4.3\ttests/y.py::c\n")
    notes = tmp_path / "n.json"
    notes.write_text(json.dumps({"tests/x.py": "smaller inputs"}))
    out = tmp_path / "r.json"
    assert st.main(["summarize", "--before", str(before), "--after", str(after), "--notes", str(notes),
                    "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["files"]["tests/x.py"] == {"tests_before": 2, "tests_after": 2, "cpu_s_before": 12.5,
                                        "cpu_s_after": 3.5, "cpu_s_saved": 9.0, "changed": "smaller inputs"}
    assert r["files"]["tests/y.py"]["cpu_s_saved"] == -0.25 and r["files"]["tests/y.py"]["changed"] == ""
    assert (r["cpu_s_before"], r["cpu_s_after"], r["cpu_s_saved"]) == (16.5, 7.75, 8.75)


def test_a_test_only_one_run_has_counts_on_its_side(tmp_path):
    before, after = tmp_path / "b.tsv", tmp_path / "a.tsv"
    before.write_text("5.00\t5.0\ttests/x.py::a[k256]\n1.00\t1.0\ttests/x.py::a[mini]\n")
    after.write_text("1.00\t1.0\ttests/x.py::a[mini]\n0.75\t0.8\ttests/x.py::a[k256-fp8]\n")
    r = st.summarize(st.read_tsv(before), st.read_tsv(after), {})
    assert r["files"]["tests/x.py"]["tests_before"] == r["files"]["tests/x.py"]["tests_after"] == 2
    assert r["files"]["tests/x.py"]["cpu_s_saved"] == 4.25


def test_a_whole_run_line_counts_its_tests(tmp_path):
    tsv = tmp_path / "w.tsv"
    tsv.write_text("30.50\t90.0\ttests/k.py::* (6 tests, whole pytest run)\n")
    assert st.by_file(st.read_tsv(tsv))["tests/k.py"] == {"tests": 6, "cpu_s": 30.5}
