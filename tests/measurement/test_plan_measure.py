"""`mixq plan --measure`: measured trellis curves feed the knapsack; the curves file round-trips."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mixq.cli import main
from mixq.measurement import trellis as cs
from mixq.measurement.trellis import measure_proxy
from mixq.planning.planner import plan_model
from mixq.formats.checkpoint import open_checkpoint

CURVES = Path(__file__).resolve().parents[2] / "bench" / "results" / "measure_mini_curves.json"


@pytest.mark.parametrize("bpw", [2.5, 3.05, 4.0])
def test_measured_plan_beats_role_defaults_at_same_budget(mini_model, bpw):
    """The curves measured on mini (bench/results, `--measure` at default sampling): the knapsack's plan has a
    predicted total loss no higher than the role-default plan's at the same budget, and meets the budget."""
    ck = open_checkpoint(mini_model)
    curves = cs.load_curves(CURVES)
    assert len(curves) == 26
    ref = plan_model(ck, "exl3", bpw=bpw)
    got = plan_model(ck, "exl3", bpw=bpw, measure=curves)
    assert got.bpw <= bpw + 1e-9 and got.bpw >= bpw - 0.05
    assert ref.bpw <= bpw + 1e-9
    e_ref, e_got = cs.predicted_loss(ref, curves, ck), cs.predicted_loss(got, curves, ck)
    assert e_got <= e_ref
    assert e_got < 0.9 * e_ref  # on mini the measured allocation is clearly better, not a tie
    # the same under a byte budget: the role-default plan's size
    by_size = plan_model(ck, "exl3", size=ref.total_bytes, measure=curves)
    assert by_size.total_bytes <= ref.total_bytes
    assert cs.predicted_loss(by_size, curves, ck) <= e_ref


def test_curves_file_shape_and_round_trip(tmp_path):
    curves = cs.load_curves(CURVES)
    for key, c in curves.items():
        vals = [c[b] for b in sorted(c)]
        assert sorted(c) == [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0]
        assert all(a > b > 0 for a, b in zip(vals, vals[1:])), key
    out = tmp_path / "c.json"
    cs.save_curves(curves, out, meta={"note": "x"})
    assert cs.load_curves(out) == curves
    assert json.loads(out.read_text())["_meta"] == {"note": "x"}


@pytest.fixture(scope="module")
def tiny2(tmp_path_factory) -> Path:
    """A 2-layer tiny checkpoint (KDA + dense MLP, KDA + 2 experts; no NextN, no vision): 11 budgeted units."""
    from mixq.formats.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny2") / "m", nextn=False, vision=False,
                                 layer_types=("linear_attention", "linear_attention"))


@pytest.mark.slow  # one of the longest of the default run: bench/results/ci_fresh_clone_283e8d1_durations.tsv
def test_cli_plan_measure_tiny(tiny2, tmp_path, monkeypatch):
    """`mixq plan --measure --json` on a tiny random checkpoint with heavy sampling (2 rates, 1 strip,
    1 expert, 2 calibration rows), then `--measure FILE` reuses the saved curves and gives the same plan."""
    tiny_model = tiny2
    monkeypatch.setattr(cs, "RATES", (2.0, 4.0))
    monkeypatch.setattr(cs, "MEASURE_ROWS", 2)
    monkeypatch.setattr(cs, "MEASURE_SEQ_LEN", 32)
    monkeypatch.setitem(cs.SAMPLING, "cpu", (1, 1))
    out = tmp_path / "curves.json"
    base = ["plan", str(tiny_model), "--format", "exl3", "--bpw", "3.05", "--json"]
    r = CliRunner().invoke(main, base + ["--measure", "trellis", "--measure-out", str(out)])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output[r.output.index("{"):])
    assert 2.9 <= plan["bpw"] <= 3.05
    curves = cs.load_curves(out)
    ck = open_checkpoint(tiny_model)
    assert set(curves) == set(cs.budget_units(ck)) and "layers.1.experts" in curves
    assert all(c[2.0] > c[4.0] > 0 for c in curves.values())
    bits = {t["name"]: t["bits"] for t in plan["tensors"] if t["bits"] is not None}
    assert {b for n, b in bits.items() if ck.info(n).exl3_bits_key == "bits"} <= {2.0, 4.0}
    r2 = CliRunner().invoke(main, base + ["--measure", str(out)])
    assert r2.exit_code == 0, r2.output
    assert json.loads(r2.output[r2.output.index("{"):])["tensors"] == plan["tensors"]


def test_cli_measure_errors(tiny2, tmp_path):
    tiny_model = tiny2
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    for extra, msg in ((["--measure", str(bad)], "expected JSON"),
                       (["--measure-out", str(tmp_path / "x.json")], "--measure-out needs --measure")):
        r = CliRunner().invoke(main, ["plan", str(tiny_model), "--format", "exl3", "--bpw", "3"] + extra)
        assert r.exit_code == 2 and msg in r.output, r.output
    r = CliRunner().invoke(main, ["plan", str(tiny_model), "--format", "gguf", "--bpw", "3", "--measure", "trellis"])
    assert r.exit_code == 2 and "EXL3's trellis measurement" in r.output, r.output
    r = CliRunner().invoke(main, ["plan", str(tiny_model), "--format", "exl3", "--bpw", "3", "--measure",
                                  "--measure-sample", "0,2"])
    assert r.exit_code == 2 and "--measure-sample '0,2'" in r.output, r.output


def test_measure_sample_parsing():
    assert cs.parse_sample("4,8") == (4, 8)
    assert cs.parse_sample("all") == (None, None)
    assert cs.parse_sample("all,2") == (None, 2)
    assert cs.parse_sample("auto") == ("auto", "auto")


@pytest.mark.slow
def test_measure_proxy_plans_mini(mini_model, calibration_text):
    """The old Hessian-trace proxy (`--measure proxy`) still gives every unit a curve."""
    ck = open_checkpoint(mini_model)
    curves = measure_proxy(ck, [str(calibration_text)], rows=4, seq_len=64)
    assert "layers.1.experts" in curves and "layers.0.self_attn.qkv_proj" in curves
    assert all(v[2.0] > v[4.0] > 0 for v in curves.values())
    p = plan_model(ck, "exl3", bpw=3.05, measure=curves)
    assert abs(p.bpw - 3.05) <= 0.02


def test_kld_gains_and_weighting(tiny2, monkeypatch):
    """`--measure kld`: every unit's end-to-end KLD under trellis-sized noise is positive and finite, grows when the
    noise grows (fewer reference bits), and the weighted curves keep each unit's shape with that KLD at ref_bits."""
    from mixq.measurement import kld as plan_kld

    ck = open_checkpoint(tiny2)
    units = sorted(cs.budget_units(ck))
    g3 = plan_kld.kld_gains(ck, units, rows=2, seq_len=32, ref_bits=3.0, progress=False)
    g1 = plan_kld.kld_gains(ck, units, rows=2, seq_len=32, ref_bits=1.0, progress=False)
    assert set(g3) == set(units) and all(0 < v < 1 for v in g3.values())
    assert all(g1[k] > 1.5 * g3[k] for k in units)  # 16x the noise variance (random tiny weights: 2.5-17x the KLD)
    curves = {k: {2.0: 8.0, 3.0: 2.0, 4.0: 0.5} for k in units}
    w = plan_kld.kld_weighted(curves, g3)
    assert all(abs(w[k][3.0] - g3[k]) < 1e-12 and abs(w[k][2.0] / w[k][4.0] - 16) < 1e-9 for k in units)
    with pytest.raises(Exception, match="no gain"):
        plan_kld.kld_weighted({"x": {3.0: 1.0}}, {})
