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
