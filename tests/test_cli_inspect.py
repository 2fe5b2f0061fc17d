"""`mixq inspect`: JSON and table on the trained fixture; bad input -> exit 2 and one line."""
from __future__ import annotations

import json

from click.testing import CliRunner

from mixq.cli import main


def _run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def test_inspect_json_mini(mini_model):
    r = _run("inspect", mini_model, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["model_type"] == "glm5_next" and d["num_hidden_layers"] == 4 and d["nextn_layers"] == [4]
    assert d["params"] == 4_689_566
    assert len(d["tensors"]) == 354
    assert sum(r["params"] for r in d["roles"].values()) == d["params"]
    assert sum(r["tensors"] for r in d["roles"].values()) == 354
    assert d["roles"]["routed_expert"] == {"tensors": 192, "params": 1_572_864, "bytes": 3_145_728}
    for t in d["tensors"]:
        assert t["mtp"] == t["name"].startswith("model.language_model.layers.4."), t
        assert set(t) == {"name", "shape", "dtype", "role", "layer", "mtp"}
    assert {t["dtype"] for t in d["tensors"]} == {"bfloat16"}


def test_inspect_table_fp8(k256_fp8_model):
    r = _run("inspect", k256_fp8_model)
    assert r.exit_code == 0, r.output
    assert "float8_e4m3fn ×224" in r.stdout and "bfloat16 ×130" in r.stdout
    assert "20,699,364" in r.stdout and "routed_expert" in r.stdout and "KDA×3 DSA×1" in r.stdout


def test_inspect_bad_input_exit_2_one_line(bad_checkpoint):
    kind, path, fragment = bad_checkpoint
    r = _run("inspect", path)
    assert r.exit_code == 2, (kind, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mixq: error:") and fragment in lines[0], (kind, lines)
    assert "Traceback" not in r.output and r.stdout == ""
