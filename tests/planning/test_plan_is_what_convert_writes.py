"""`mixq plan --format gguf` shows the types `mixq convert` writes: one assignment (planning/gguf_assign) serves
both, and the file read back by gguf-py holds, tensor by tensor, the plan's type and byte count."""
from __future__ import annotations

import pytest
from gguf import GGUFReader

import mixq


@pytest.mark.parametrize("target", [{"qtype": "Q4_K_M"}, {"qtype": "IQ3_M"}, {"bpw": 5.0}],
                         ids=["Q4_K_M", "IQ3_M", "bpw5"])
def test_every_planned_tensor_is_written_with_its_type_and_bytes(mini_model, tmp_path, target):
    plan = mixq.plan(mini_model, "gguf", **target)
    out = tmp_path / "m.gguf"
    mixq.convert(mini_model, out, "gguf", threads=1, progress=False, **target)
    written = {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in GGUFReader(out).tensors}
    planned = {t.name: (t.type, t.bytes) for t in plan.tensors}
    assert written == planned
    assert len({t for t, _ in planned.values()}) > 2  # a mix, not one type everywhere


def test_plan_type_with_imatrix_plans_what_an_imatrix_conversion_takes(k256_model, tmp_path):
    """llama-quantize's IQ3_XXS mix puts the attn_v tensors at IQ3_S without an importance matrix and keeps them at
    IQ3_XXS with one: `plan --type IQ3_XXS --imatrix IMX` plans the latter (the file is only named, not read)."""
    imx = tmp_path / "imx.gguf"
    imx.write_bytes(b"")
    without = {t.name: t.type for t in mixq.plan(k256_model, "gguf", qtype="IQ3_XXS").tensors}
    with_ = {t.name: t.type for t in mixq.plan(k256_model, "gguf", qtype="IQ3_XXS", imatrix=imx).tensors}
    assert without["blk.0.attn_v.weight"] == "IQ3_S" and with_["blk.0.attn_v.weight"] == "IQ3_XXS"
    assert without["blk.0.attn_q.weight"] == with_["blk.0.attn_q.weight"] == "IQ2_S"
