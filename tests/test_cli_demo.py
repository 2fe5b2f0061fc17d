"""`mixq demo` from the command line: every step but EXL3 (tests/conversion/test_demo.py runs that one, slow)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mixq.cli import main


def test_demo_runs_every_step_but_exl3(tmp_path):
    out = tmp_path / "d"
    r = CliRunner().invoke(main, ["demo", "--out", str(out), "--no-exl3", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert list(rep["steps"]) == ["model", "inspect", "plan", "convert_gguf", "verify", "eval"]
    ins = rep["steps"]["inspect"]
    assert ins["layer_types"] == ["linear_attention", "deepseek_sparse_attention"] and ins["nextn_layers"] == [2]
    d = json.loads((out / "inspect.json").read_text())
    assert sum(v["params"] for v in d["roles"].values()) == d["params"] == ins["params"]
    assert "vision" not in ins["roles"] and ins["routed_experts"] == 2
    # the plan's size and bpw predict the written file's: one bpw definition (file bytes x 8 / model params)
    plan, gguf = rep["steps"]["plan"], rep["steps"]["convert_gguf"]
    assert plan["ref_params"] == ins["params"]
    assert (out / "tiny-Q8_0.gguf").stat().st_size == gguf["file_bytes"]
    assert abs(plan["gguf_bytes"] - gguf["file_bytes"]) / gguf["file_bytes"] < 0.01
    assert gguf["file_bpw"] == round(gguf["file_bytes"] * 8 / ins["params"], 3)
    assert rep["steps"]["verify"]["problems"] == {"gguf": 0}
    ev = rep["steps"]["eval"]
    (cand,) = ev["candidates"]
    assert cand["name"] == "tiny-Q8_0.gguf" and cand["file_bpw"] == gguf["file_bpw"]
    assert 0 <= cand["kld_mean"] < 0.01 and cand["top1"] > 0.9 and ev["windows"] == 4
    assert json.loads((out / "eval.json").read_text())["windows"] == 4


def test_demo_summary_is_readable(tmp_path):
    # the summary the command prints without --json: every step, what the numbers mean, what to try next
    from mixq.demo_run import format_demo

    report = {"out": "mixq-demo", "seconds": 100.0, "steps": {
        "model": {"path": "mixq-demo/tiny-glm5next", "seconds": 3.0},
        "inspect": {"tensors": 118, "params": 1_000_000, "layers": 2,
                    "layer_types": ["linear_attention", "deepseek_sparse_attention"], "nextn_layers": [2],
                    "routed_experts": 2, "roles": {"attn": 40}, "seconds": 0.1},
        "plan": {"gguf_bytes": 1_100_000, "gguf_file_bpw": 8.8, "exl3_bytes": 900_000, "exl3_file_bpw": 7.2,
                 "exl3_bits": 3.05, "ref_params": 1_000_000, "seconds": 1.0},
        "convert_gguf": {"out": "mixq-demo/tiny-Q8_0.gguf", "file_bytes": 1_100_123, "file_bpw": 8.801,
                         "tensors": 120, "device": "cpu", "seconds": 10.0},
        "convert_exl3": {"out": "mixq-demo/tiny-exl3-3.05", "file_bytes": 900_456, "file_bpw": 7.204,
                         "tensors": 90, "device": "cpu", "bits": 3.05, "quantized": 20, "seconds": 80.0},
        "verify": {"problems": {"gguf": 0, "exl3": 0}, "seconds": 2.0},
        "eval": {"windows": 4, "ctx": 128, "file": "mixq-demo/eval.json", "seconds": 9.0, "candidates": [
            {"name": "tiny-Q8_0.gguf", "file_bpw": 8.801, "kld_mean": 0.0001, "top1": 0.99, "positions": 252},
            {"name": "tiny-exl3-3.05", "file_bpw": 7.204, "kld_mean": 0.02, "top1": 0.9, "positions": 252}]}}}
    text = format_demo(report)
    for needle in ("1,000,000 parameters in 118 tensors", "2 decoder layers (KDA + DSA)", "8.80 bpw",
                   "tiny-exl3-3.05: 0.90 MB, 7.20 bpw (3.05 exllamav3 bits", "GGUF 0 problems, EXL3 0 problems",
                   "KLD 0.020000   top-1 90.0%", "What the numbers mean:", "mixq convert MODEL model-Q4_K_M.gguf"):
        assert needle in text, needle
    assert "{" not in text  # no raw dicts or JSON


def test_demo_refuses_unknown_steps_to_skip(tmp_path):
    from mixq.demo_run import run_demo
    from mixq.errors import InputError

    with pytest.raises(InputError, match="'exl4'"):
        run_demo(tmp_path / "d", skip=("exl4",))
    assert not (tmp_path / "d").exists()
