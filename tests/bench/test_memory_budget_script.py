"""bench/release/memory_budget.py: its estimate-only mode on GLM-5.3-Flash's config (the verbs' own estimates, a 24 GB
card refused by name), and (slow) the whole script on a toy slice on the CPU: every verb run under a large budget,
refused under a tiny one, with its seconds, peaks and lines recorded."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "release" / "memory_budget.py"


def _module():
    spec = importlib.util.spec_from_file_location("memory_budget_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_estimate_only_on_the_release_config(tmp_path):
    from conftest import shared_path
    shared_path("models", "glm-5.3-flash-shape", "config.json")
    out = tmp_path / "e.json"
    d = _module().main(["--estimate-only", "--json", str(out), "--budgets", "80GB,24GB"])
    assert json.loads(out.read_text())["budgets"].keys() == {"80GB", "24GB"}
    big, small = d["budgets"]["80GB"], d["budgets"]["24GB"]
    assert big["exl3"]["refusal"] is None and big["imatrix"]["refusal"] is None
    enc = next(s for s in big["exl3"]["stages"] if s["stage"] == "exl3_encode")
    assert enc["need"] <= big["exl3"]["budget_bytes"]
    # 24 GB: the routed experts go through the card in groups, except where the GGUF tuning holds a whole layer
    for verb in ("exl3", "gguf_hessian_untuned", "imatrix"):
        assert small[verb]["refusal"] is None
        cal = next(s for s in small[verb]["stages"] if s["stage"] == "calibration")
        assert 1 < cal["piece"] < 288, cal
    assert "the calibration stage needs" in small["gguf_hessian"]["refusal"]
    assert small["exl3"]["line"].startswith("memory: GPU cuda needs ~")


@pytest.mark.slow
def test_the_script_runs_on_a_toy_slice_on_the_cpu(tmp_path):
    out = tmp_path / "mb.json"
    subprocess.run([sys.executable, str(SCRIPT), "--work", str(tmp_path / "w"), "--json", str(out), "--small",
                    "--device", "cpu", "--experts", "4", "--budgets", "4GB,1MB", "--verbs", "imatrix,gguf,eval",
                    "--gguf-args=--type Q8_0", "--rows", "2", "--seq-len", "32", "--eval-ctx", "64",
                    "--eval-windows", "1"], check=True, capture_output=True, text=True)
    d = json.loads(out.read_text())
    runs = {(r["verb"], r["budget"]): r for r in d["runs"]}
    assert set(runs) == {(v, b) for v in ("imatrix", "gguf", "eval") for b in ("4GB", "1MB")}
    for v in ("imatrix", "gguf", "eval"):
        ok, refused = runs[(v, "4GB")], runs[(v, "1MB")]
        assert ok["rc"] == 0 and ok["seconds"] > 0 and ok["peak_host_mib"] > 0, ok
        assert ok["memory_line"].startswith(f"mixq {'convert' if v == 'gguf' else v}: memory: device cpu needs")
        assert ok["memory"]["budget_bytes"] == 4 * 10**9
        assert refused["rc"] == 2 and refused["refusal"].startswith("mixq: error: --gpu-memory 0.95 MiB: the ")
