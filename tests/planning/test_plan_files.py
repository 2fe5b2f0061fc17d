"""The files `mixq convert` writes for a plan match the plan's bytes within 0.5%. Slow."""
from __future__ import annotations

from pathlib import Path

import pytest

from mixq.planning.planner import plan_model

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model", ["glm5next-mini", "glm5next-k256"])
def test_gguf_q4_k_m_file_matches_plan(model, tmp_path, mini_model):
    from mixq.conversion.gguf.pipeline import convert_gguf

    path = Path(mini_model).parent / model
    res = convert_gguf(path, tmp_path / "m.gguf", qtype="Q4_K_M", progress=False)
    plan = plan_model(path, "gguf", qtype="Q4_K_M")
    written = sum(Path(f).stat().st_size for f in res["files"])
    assert abs(plan.total_bytes / written - 1) < 0.005
    assert res["bytes"] == sum(t.bytes for t in plan.tensors)  # tensor data: exact


def test_exl3_file_matches_plan(tmp_path, mini_model):
    import struct

    from mixq.conversion.api import convert

    convert(mini_model, tmp_path / "out", "exl3", bpw=3.05, rows=4, seq_len=64, progress=False)
    plan = plan_model(mini_model, "exl3", bpw=3.05)
    shards = list((tmp_path / "out").glob("*.safetensors"))
    written = sum(f.stat().st_size for f in shards)
    headers = sum(8 + struct.unpack("<Q", f.open("rb").read(8))[0] for f in shards)
    assert written - headers == sum(t.bytes for t in plan.tensors)  # tensor data: exact
    assert abs(plan.total_bytes / written - 1) < 0.005
