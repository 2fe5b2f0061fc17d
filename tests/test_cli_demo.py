"""`mixq demo` writes a tiny checkpoint and runs every step on it."""
from __future__ import annotations

import json

from click.testing import CliRunner

from mixq.cli import main


def test_demo_runs_every_step(tmp_path):
    r = CliRunner().invoke(main, ["demo", "--out", str(tmp_path / "d"), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["steps"]["inspect"]["tensors"] == 186 and rep["steps"]["inspect"]["nextn_layers"] == [4]
    d = json.loads((tmp_path / "d" / "inspect.json").read_text())
    assert sum(v["params"] for v in d["roles"].values()) == d["params"] == rep["steps"]["inspect"]["params"]
    assert set(rep["steps"]) == {"inspect", "plan", "convert", "verify", "eval"}
    assert abs(rep["steps"]["plan"]["exl3_bpw"] - 3.05) <= 0.02
    assert rep["steps"]["verify"]["problems"] == 0
    assert (tmp_path / "d" / "tiny-Q8_0.gguf").stat().st_size == rep["steps"]["convert"]["bytes"]
    ev = rep["steps"]["eval"]
    if "skipped" not in ev:  # needs the fixtures' tokenizer
        assert 0 <= ev["kld_mean"] < 0.01 and ev["top1"] > 0.9
