"""`--pin`: a measured plan keeps the pinned groups at the role plan's bits / types, within the same byte target,
and `mixq convert` writes what `mixq plan` shows for such a plan."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cli_helpers import run_cli
from gguf import GGUFReader

import mixq
from mixq.errors import InputError
from mixq.formats.checkpoint import open_checkpoint
from mixq.planning.gguf_measured import measured_units
from mixq.planning.gguf_mix import type_bpw
from mixq.planning.pin import PIN_NAMES, is_pinned
from mixq.planning.planner import plan_model
from mixq.measurement.trellis import load_curves

ALL = ",".join(PIN_NAMES)
# mini's EXL3 curves of `mixq plan --measure` (= kld), bench/quality/measure_mini.py
EXL3_CURVES = Path(__file__).resolve().parents[2] / "bench" / "results" / "measure_mini_kld_curves.json"


def gguf_curves(model, path: Path) -> Path:
    """GGUF curves for mini, written to `path`: every budgeted tensor's error numel·4^(−bpw) at every K-ladder
    type, token_embd, output and layer 0 weighted 100x (the fixtures' levers a measured plan moves bits into),
    layer L (1 + L)² times."""
    ck = open_checkpoint(model)
    curves = {}
    for name, (spec, ladder) in measured_units(ck).items():
        w = 100.0 if spec.role in ("embed", "lm_head") or spec.layer == 0 else (1 + spec.layer) ** 2
        curves[name] = {str(type_bpw(t)): w * math.prod(spec.shape) * 4.0 ** -type_bpw(t) for t in ladder}
    path.write_text(json.dumps(curves))
    return path


def _choices(plan, names) -> dict:
    return {t.name: (t.type, t.bits) for t in plan.tensors if t.name in names}


@pytest.mark.parametrize("fmt", ["exl3", "gguf"])
def test_pinned_tensors_keep_the_role_plans_choice_at_the_same_bytes(mini_model, fmt, tmp_path):
    ck = open_checkpoint(mini_model)
    curves = load_curves(EXL3_CURVES if fmt == "exl3" else gguf_curves(mini_model, tmp_path / "curves.json"))
    size = (plan_model(ck, fmt, bpw=3.05) if fmt == "exl3" else plan_model(ck, fmt, bpw=5.0)).total_bytes
    role = plan_model(ck, fmt, size=size)
    free = plan_model(ck, fmt, size=size, measure=curves)
    pinned = plan_model(ck, fmt, size=size, measure=curves, pin=ALL)
    names = {t.name for t in role.tensors if t.hf_names and all(is_pinned(ck.info(h), PIN_NAMES) for h in t.hf_names)}
    assert any(ck.info(t.hf_names[0]).layer == 0 for t in role.tensors if t.name in names)
    assert _choices(pinned, names) == _choices(role, names)
    assert _choices(free, names) != _choices(role, names)  # without --pin the measured plan moves them
    rest = {t.name for t in role.tensors} - names
    assert _choices(pinned, rest) != _choices(role, rest)  # the rest is still planned by the curves
    assert max(free.total_bytes, pinned.total_bytes) <= size
    assert pinned.total_bytes >= 0.99 * size


def test_pin_is_checked_when_built():
    with pytest.raises(InputError, match="--pin 'layer9': not a pinnable group"):
        mixq.PlanOptions(fmt="gguf", pin="token_embd,layer9")
    assert mixq.PlanOptions(fmt="gguf", pin="layer0, output").pin == ("output", "layer0")


def test_a_pinned_measured_gguf_is_written_as_planned(mini_model, tmp_path):
    curves = gguf_curves(mini_model, tmp_path / "curves.json")
    args = ["--bpw", "5.0", "--measure", str(curves), "--pin", "token_embd,output,layer0"]
    out = tmp_path / "m.gguf"
    r = run_cli("convert", mini_model, out, "--threads", "1", *args)
    assert r.exit_code == 0, r.output[-2000:]
    r = run_cli("plan", mini_model, "--format", "gguf", "--json", *args)
    assert r.exit_code == 0, r.output[-2000:]
    planned = {t["name"]: (t["type"], t["bytes"]) for t in json.loads(r.stdout)["tensors"]}
    written = {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in GGUFReader(out).tensors}
    assert written == planned
    role = {t.name: t.type for t in plan_model(open_checkpoint(mini_model), "gguf", bpw=5.0).tensors}
    assert all(written[n][0] == role[n] for n in ("token_embd.weight", "output.weight", "blk.0.attn_q.weight"))
