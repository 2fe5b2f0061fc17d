"""`mixq eval` and `mixq compare` through click."""
from __future__ import annotations

import json

from click.testing import CliRunner

from mixq.cli import main

from .test_api import KEYS


def test_eval_cli_json_keys(first_run, mini_model, noisy_candidates):
    _, ref_file, _ = first_run
    res = CliRunner().invoke(main, ["eval", str(mini_model), str(noisy_candidates[0]), "--ref-logits", str(ref_file), "--windows", "1", "--json", "-"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output[res.output.index("{"):])
    assert list(rep)[:3] == ["reference", "text", "ctx"] and "candidates" in rep
    assert list(rep["candidates"][0])[: len(KEYS)] == KEYS
    assert rep["candidates"][0]["positions"] == 63 and rep["candidates"][0]["kld_mean"] > 0


def test_eval_cli_errors_are_one_line(mini_model, tmp_path):
    res = CliRunner().invoke(main, ["eval", str(mini_model), str(tmp_path / "missing.gguf"), "--text", str(tmp_path / "t.txt")])
    assert res.exit_code == 2
    assert "mixq: error:" in res.output and "Traceback" not in res.output


def test_compare_cli(first_run, tmp_path):
    _, _, out = first_run
    png = tmp_path / "p.png"
    res = CliRunner().invoke(main, ["compare", str(out / "report.json"), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "| noise-small | hf | torch |" in res.output and png.stat().st_size > 0
