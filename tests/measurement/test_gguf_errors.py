"""measurement/gguf_errors.py: measured GGUF error curves and the measured --size/--bpw plan (glm5next-k256)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from mixq.measurement import gguf_errors as gmeas
from mixq.errors import InputError, PlanError
from mixq.planning import allocator as al
from mixq.planning import gguf_measured as gmp
from mixq.planning import gguf_mix as gm

# the files llama.cpp's named mixes make of k256 (bench/results/k256.md): Q2_K, Q3_K_M, Q4_K_M
NAMED_MIX_BYTES = (10_772_320, 12_674_400, 14_816_096)


@pytest.fixture(scope="module")
def k256(k256_model):
    from mixq.formats.checkpoint import open_checkpoint

    return open_checkpoint(k256_model)


def _model_curves(k256) -> dict:
    """Curves shaped like a good quantizer's (numel·4^-bpw), token_embd and attention made costlier."""
    out = {}
    for name, (spec, lad) in gmp.measured_units(k256).items():
        w = 20.0 if spec.role in ("embed", "attn") else 1.0
        out[name] = {gm.type_bpw(t): w * math.prod(spec.shape) * 4.0 ** -gm.type_bpw(t) for t in lad}
    return out


def test_measured_units_add_embedding_and_head(k256):
    units = gmp.measured_units(k256)
    roles = {s.role for s, _ in units.values()}
    assert {"embed", "lm_head", "routed_expert", "attn", "shared_expert", "dense_mlp"} <= roles
    assert not any(s.mtp for s, _ in units.values())
    assert "blk.1.ffn_gate_exps.weight" in units and "token_embd.weight" in units
    assert units["token_embd.weight"][1] == ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0"]
    assert gmeas.reference_type(units["token_embd.weight"][1]) == "Q3_K"


@pytest.mark.parametrize("size", NAMED_MIX_BYTES)
def test_measured_plan_hits_the_size_within_a_thousandth(size, k256):
    plan = gmp.plan_gguf_measured(k256, _model_curves(k256), size=size)
    assert plan.total_bytes <= size and (size - plan.total_bytes) / size < 1e-3
    types = {t.name: t.type for t in plan.tensors}
    # costlier units get more bits than cheap ones of the same shape
    assert gm.type_bpw(types["blk.1.attn_q.weight"]) > gm.type_bpw(types["blk.1.ffn_gate_shexp.weight"])
    assert not plan.measured["role_plan_taken"]


def test_measured_plan_follows_the_curves(k256):
    curves = _model_curves(k256)
    hot = "blk.2.ffn_down_exps.weight"
    base = gmp.plan_gguf_measured(k256, curves, size=NAMED_MIX_BYTES[1])
    curves[hot] = {b: 50 * e for b, e in curves[hot].items()}
    hotter = gmp.plan_gguf_measured(k256, curves, size=NAMED_MIX_BYTES[1])
    t0 = {t.name: t.type for t in base.tensors}[hot]
    t1 = {t.name: t.type for t in hotter.tensors}[hot]
    assert gm.type_bpw(t1) > gm.type_bpw(t0)


def test_never_worse_takes_the_role_plan_when_greedy_stalls():
    # unit a: its best hull step (level 0 -> 2) does not fit; the role plan's step to level 1 does
    a = al.Unit("a", "attn", 10, levels=(2.0, 3.0, 4.0), costs=(0.0, 10.0, 40.0), errors=(10.0, 9.9, 0.0))
    greedy = al.allocate([a], 10.0)
    assert greedy["a"] == 2.0
    levels, taken = gmp.never_worse([a], greedy, 10.0, {"attn": 6.0})
    assert taken and levels["a"] == 3.0


def test_missing_curves_and_bad_targets_are_one_line(k256):
    curves = _model_curves(k256)
    del curves["blk.0.attn_q.weight"]
    with pytest.raises(PlanError, match="no measured error for blk.0.attn_q.weight"):
        gmp.plan_gguf_measured(k256, curves, size=NAMED_MIX_BYTES[0])
    with pytest.raises(PlanError, match="exactly one of --bpw, --size"):
        gmp.plan_gguf_measured(k256, _model_curves(k256))
    with pytest.raises(PlanError, match="fixed-type tensors alone"):
        gmp.plan_gguf_measured(k256, _model_curves(k256), size=1_000_000)
    with pytest.raises(InputError, match="blk.9.attn_q.weight is not a budgeted GGUF tensor"):
        gmeas.measure_gguf_errors(k256, only=["blk.9.attn_q.weight"], progress=False)


def _check_curves(k256, calibration_text, names, linears):
    kw = dict(rows=2, seq_len=64, only=names, progress=False)
    exact = gmeas.measure_gguf_errors(k256, [calibration_text], rounding="exact", **kw)
    hess = gmeas.measure_gguf_errors(k256, [calibration_text], rounding="hessian", **kw)
    for n in names:
        e = [exact.curves[n][b] for b in sorted(exact.curves[n])]
        assert all(x > y for x, y in zip(e, e[1:])), n
        assert hess.reference_error[n] == pytest.approx(exact.curves[n][gm.type_bpw(exact.reference[n])])
    for n in linears:  # the rounding lowers the layer error at every type (in-sample)
        assert all(hess.curves[n][b] < exact.curves[n][b] for b in exact.curves[n]), n


@pytest.mark.slow
def test_measured_errors_fall_with_bits_and_hessian_rounding_helps(k256, calibration_text):
    _check_curves(k256, calibration_text, ["blk.0.attn_q.weight"], ["blk.0.attn_q.weight"])


@pytest.mark.slow
def test_measured_errors_of_embedding_head_and_experts(k256, calibration_text):
    names = ["token_embd.weight", "output.weight", "blk.1.ffn_down_exps.weight"]
    _check_curves(k256, calibration_text, names, names[1:])


def test_cli_plan_gguf_measure_passes_rounding_and_imatrix(k256_model, tmp_path, monkeypatch):
    """`mixq plan --format gguf --size S --measure kld --rounding hessian --imatrix IMX --measure-out F`: the oracle
    gets the conversion's rounding and imatrix, the curves are saved, the plan budgets the embedding."""
    import json

    from click.testing import CliRunner

    import mixq.measurement.gguf_kld as gk
    from mixq.cli import main
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.imatrix_file import IMatrix, write_imatrix

    seen = {}

    def fake_curves(ckpt, calibration=None, *, ladder, rounding, imatrix, device, cache=None, progress):
        seen.update(rounding=rounding, imatrix=imatrix, ladder=ladder)
        return _model_curves(ckpt)

    monkeypatch.setattr(gk, "gguf_kld_curves", fake_curves)
    ck = open_checkpoint(k256_model)
    im = IMatrix(datasets=["x"], chunk_count=1, chunk_size=8)
    im.add("blk.0.attn_q.weight", np.ones((1, 256), np.float32), np.array([8.0]))
    write_imatrix(tmp_path / "imx.gguf", im)
    out = tmp_path / "curves.json"
    r = CliRunner().invoke(main, ["plan", str(k256_model), "--format", "gguf", "--size", str(NAMED_MIX_BYTES[1]),
                                  "--measure", "kld", "--rounding", "hessian", "--imatrix", str(tmp_path / "imx.gguf"),
                                  "--measure-out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert seen["rounding"] == "hessian" and seen["ladder"] == "k"
    assert np.allclose(seen["imatrix"]["blk.0.attn_q.weight"], 1.0 / 8)  # Σx² / count, as the converter reads it
    assert set(json.loads(out.read_text())) - {"_meta"} == set(_model_curves(ck))
    plan = json.loads(r.output[r.output.index("{"):])
    types = {t["name"]: t["type"] for t in plan["tensors"]}
    assert types["token_embd.weight"] != "BF16"
    r = CliRunner().invoke(main, ["plan", str(k256_model), "--format", "gguf", "--bpw", "4", "--rounding", "hessian"])
    assert r.exit_code == 2 and "--rounding applies to" in r.output
