"""`--measure` sensitivity proxy: one calibration pass gives every budgeted EXL3 unit a curve. Slow."""
from __future__ import annotations

import pytest

from mixq.convert.planning import measure_proxy, plan_model
from mixq.formats.checkpoint import open_checkpoint

pytestmark = pytest.mark.slow


def test_measure_proxy_plans_mini(mini_model, calibration_text):
    ck = open_checkpoint(mini_model)
    curves = measure_proxy(ck, [str(calibration_text)], rows=4, seq_len=64)
    assert "layers.1.experts" in curves and "layers.0.self_attn.qkv_proj" in curves
    assert all(v[2.0] > v[4.0] > 0 for v in curves.values())
    p = plan_model(ck, "exl3", bpw=3.05, measure=curves)
    assert abs(p.bpw - 3.05) <= 0.02
