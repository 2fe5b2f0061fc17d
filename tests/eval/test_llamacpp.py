"""`--engine llamacpp`: KLD of a GGUF candidate from llama.cpp's own logits vs from its dequantized weights.

Required: for a GGUF at Q4_K_M or smaller the two differ by at most 5% + 3e-4 (llama.cpp's activation
quantization alone adds about 2.4e-4). Slow: converts k256 to Q4_K_M and runs both engines."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow
pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def k256_q4km(k256_model, tmp_path_factory):
    gp = pytest.importorskip("mixq.conversion.gguf.pipeline")
    out = tmp_path_factory.mktemp("gguf") / "k256-Q4_K_M.gguf"
    gp.convert_gguf(k256_model, out, qtype="Q4_K_M", progress=False)
    return out


def test_llamacpp_kld_matches_dequantized(k256_model, k256_q4km, heldout_text, tmp_path):
    from mixq.eval import evaluate

    ref = tmp_path / "ref.safetensors"
    torch_run = evaluate(k256_model, [k256_q4km], heldout_text, ctx=512, windows=4, save_ref=ref, progress=False)
    lc_run = evaluate(k256_model, [k256_q4km], ref_logits=ref, engine="llamacpp", cache_type="f32", progress=False)
    a, b = torch_run["candidates"][0], lc_run["candidates"][0]
    assert a["engine"] == "torch" and b["engine"] == "llamacpp" and b["cache_type"] == "f32"
    assert a["positions"] == b["positions"] == 4 * 255
    assert abs(a["kld_mean"] - b["kld_mean"]) <= 0.05 * a["kld_mean"] + 3e-4, (a["kld_mean"], b["kld_mean"])
    assert b["top1"] > 0.8


def test_llamacpp_cache_types_run(k256_q4km, k256_model, heldout_text):
    from mixq.eval import evaluate

    res = {}
    for ct in ("f32", "f16"):
        r = evaluate(k256_model, [k256_q4km], heldout_text, ctx=256, windows=1, engine="llamacpp", cache_type=ct, progress=False)
        res[ct] = r["candidates"][0]["kld_mean"]
    assert all(v > 0 for v in res.values())
    assert abs(res["f16"] - res["f32"]) < 0.05 * res["f32"] + 1e-3
