"""planning/gguf_mix.py against llama-quantize itself: quantize a mixq-written BF16 GGUF with
``llama_model_quantize`` and compare every tensor's type (and the data bytes) with mixq's plan. Slow; needs
llama-cpp-python 0.3.36."""
from __future__ import annotations

import ctypes

import pytest

from mixq.planning.planner import plan_model

pytestmark = pytest.mark.slow
FTYPES = {"Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7}


@pytest.fixture(scope="module", params=["glm5next-mini", "glm5next-k256"])
def bf16_gguf(request, mini_model, tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from mixq.conversion.gguf.pipeline import convert_gguf

    model = mini_model.parent / request.param
    out = tmp_path_factory.mktemp(request.param) / "bf16.gguf"
    convert_gguf(model, out, qtype="BF16", progress=False)
    return model, out


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q2_K", "Q3_K_M", "Q5_K_M", "Q6_K", "Q8_0"])
def test_types_equal_llama_quantize(bf16_gguf, mix, tmp_path):
    import gguf
    import llama_cpp

    model, src = bf16_gguf
    dst = tmp_path / f"{mix}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[mix]
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0
    theirs = {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in gguf.GGUFReader(dst).tensors}
    plan = plan_model(model, "gguf", qtype=mix)
    ours = {t.name: (t.type, t.bytes) for t in plan.tensors}
    assert ours == theirs
