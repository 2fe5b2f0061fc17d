"""convert/planning.py + convert/fit.py + `mixq plan`: targets, overrides, impossible budgets, GLM-5.3 shape."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mixq.cli import main
from mixq.planning.fit import fit_plan
from mixq.planning.types import Plan
from mixq.planning.planner import plan_model
from mixq.errors import PlanError
from mixq.formats.checkpoint import checkpoint_from_config, open_checkpoint


def _avg(plan, role):
    bits = [t.bits for t in plan.tensors if t.role == role and t.bits is not None and ".layers.4." not in t.name]
    return sum(bits) / len(bits)


def test_mini_exl3_bpw_3_05(mini_model):
    plan = plan_model(open_checkpoint(mini_model), "exl3", bpw=3.05)
    assert abs(plan.bpw - 3.05) <= 0.02
    assert _avg(plan, "routed_expert") < _avg(plan, "attn")
    header = plan.total_bytes - sum(t.bytes for t in plan.tensors)  # safetensors headers, ~125 B per tensor
    assert 100 * 1000 < header < 160 * 1000
    # every routed expert of one layer shares one rate (exllamav3 qgroup), q/k/v share the fused rate
    for layer in (1, 2, 3):
        assert len({t.bits for t in plan.tensors if f"layers.{layer}.mlp.experts." in t.name}) == 1
    assert len({t.bits for t in plan.tensors if "layers.0.self_attn." in t.name and t.name.endswith(
        ("q_proj.weight", "k_proj.weight", "v_proj.weight"))}) == 1
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).to_dict() == plan.to_dict()


def test_overrides_exl3_and_gguf(mini_model):
    ck = open_checkpoint(mini_model)
    p = plan_model(ck, "exl3", bpw=4.0, overrides=["*.layers.1.mlp.experts.*=2", "attn=8"])
    assert {t.bits for t in p.tensors if ".layers.1.mlp.experts." in t.name} == {2.0}
    assert {t.bits for t in p.tensors if t.role == "attn" and t.type == "trellis"} == {8.0}
    g = plan_model(ck, "gguf", qtype="Q4_K_M", overrides=[r"blk\.3\.ffn_up_exps=Q8_0"])
    t = {x.name: x.type for x in g.tensors}
    assert t["blk.3.ffn_up_exps.weight"] == "Q8_0" and t["blk.2.ffn_up_exps.weight"] == "Q5_0"
    with pytest.raises(PlanError, match="matches no"):
        plan_model(ck, "gguf", qtype="Q4_K_M", overrides=["nothing_like_this=Q8_0"])


def test_cli_json_and_impossible_budget(mini_model):
    r = CliRunner().invoke(main, ["plan", str(mini_model), "--format", "gguf", "--bpw", "5", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert {"format", "total_bytes", "bpw", "tensors", "roles"} <= set(d)
    assert {"name", "role", "type", "bytes"} <= set(d["tensors"][0])
    assert abs(d["bpw"] - 5) < 0.3
    r = CliRunner().invoke(main, ["plan", str(mini_model), "--format", "exl3", "--bpw", "1.05",
                                  "--override", "routed_expert=8"])
    assert r.exit_code == 2
    assert r.output.strip().count("\n") == 0 and r.output.startswith("mixq: error:") and "too small" in r.output


@pytest.fixture(scope="module")
def flash(flash_config):
    return checkpoint_from_config(flash_config)


def test_glm53_108gb_both_formats(flash):
    e = plan_model(flash, "exl3", size="108GB")
    assert abs(e.total_bytes / 108e9 - 1) < 0.005
    assert _avg(e, "routed_expert") < _avg(e, "attn")
    g = plan_model(flash, "gguf", size="108GB", gguf_ladder="iq")
    assert abs(g.total_bytes / 108e9 - 1) < 0.005
    with pytest.raises(PlanError, match="K-quants"):
        plan_model(flash, "gguf", size="108GB")  # Q2_K (2.625 bpw) experts alone do not fit


def test_glm53_fit_121gb_262k(flash):
    f = fit_plan(flash, "gguf", fit="121GB", context=262144, cache="q8_0", gguf_ladder="iq", devices="64GB,64GB")
    assert f.cache.total == 2_897_805_312
    assert f.reserve == 4 * 10**9
    assert 0 <= f.headroom < 0.005 * 121e9
    assert abs(f.weights - (121e9 - f.cache.total - f.reserve)) < 0.005 * 121e9
    assert f.devices is not None and f.devices.fits
    with pytest.raises(PlanError, match="leave nothing"):
        fit_plan(flash, "gguf", fit="5GB", context=1048576, cache="q8_0")
    with pytest.raises(PlanError, match="equal K and V|flash attention"):
        fit_plan(flash, "gguf", fit="121GB", context=4096, cache="q4_0", flash_attn=False)


def test_cli_impossible_fit_exit_2(mini_model):
    r = CliRunner().invoke(main, ["plan", str(mini_model), "--format", "exl3", "--fit", "1GB", "--context", "4096"])
    assert r.exit_code == 2 and "leave nothing" in r.output


def test_measure_curves_drive_the_allocation(mini_model):
    from mixq.planning.exl3 import allocator_unit

    ck = open_checkpoint(mini_model)
    base = plan_model(ck, "exl3", bpw=4.0)
    keys = {allocator_unit(ck.info(t.name), t.name) for t in base.tensors
            if t.type == "trellis" and ck.info(t.name).exl3_bits_key == "bits"}
    # measured (absolute errors per unit): experts far more sensitive than everything else -> they get the bits
    curves = {k: {b: (1e4 if k.endswith(".experts") else 1.0) * 2 ** (-2 * b) for b in (2, 3, 4, 5, 6)}
              for k in keys}
    p = plan_model(ck, "exl3", bpw=4.0, measure=curves)
    assert abs(p.bpw - 4.0) <= 0.02
    assert _avg(p, "routed_expert") > _avg(p, "attn")
    with pytest.raises(PlanError, match="no error curve"):
        plan_model(ck, "exl3", bpw=4.0, measure={k: v for k, v in list(curves.items())[1:]})


def test_exl3_unquantized_bytes_are_what_the_writer_stores(k256_fp8_model):
    """The plan's storage and bytes of every unquantized tensor follow the EXL3 unit layout (one storage rule)."""
    import torch

    from mixq.formats.exl3_names import exl3_layout

    ck = open_checkpoint(k256_fp8_model)
    plan = {t.name: t for t in plan_model(ck, "exl3").tensors}
    label = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    n = 0
    for u in exl3_layout(ck):
        if u.kind == "trellis":
            continue
        for name in u.hf_names:
            t = plan[name]
            numel = torch.Size(ck.shape(name)).numel()
            assert (t.type, t.bytes) == (label[u.dtype], getattr(torch, u.dtype).itemsize * numel), name
            n += 1
    assert n > 100 and {plan[m].type for m in plan if plan[m].bits is None} >= {"bf16", "fp16", "fp32"}
