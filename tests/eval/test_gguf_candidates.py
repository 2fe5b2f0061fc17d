"""GGUF candidates (dequantized through formats/gguf_reader) on glm5next-k256: KLD falls as size rises.
Slow: writes three GGUFs and runs four models."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_kld_falls_as_size_rises(k256_model, heldout_text, tmp_path):
    gp = pytest.importorskip("mixq.conversion.gguf.pipeline")
    from mixq.eval import compare, evaluate

    files = []
    for q in ("Q2_K", "Q4_K_M", "Q8_0"):
        files.append(tmp_path / f"k256-{q}.gguf")
        gp.convert_gguf(k256_model, files[-1], qtype=q, progress=False)
    rep = evaluate(k256_model, files, heldout_text, ctx=512, windows=1, json_out=tmp_path / "r.json", progress=False)
    c = rep["candidates"]
    assert [x["format"] for x in c] == ["gguf"] * 3
    assert c[0]["bytes"] < c[1]["bytes"] < c[2]["bytes"]
    assert c[0]["kld_mean"] > c[1]["kld_mean"] > c[2]["kld_mean"] > 0
    assert c[2]["kld_mean"] < 5e-3 and c[2]["top1"] > 0.97  # Q8_0 on 255 positions (measured 0.001 / 99.4%)
    res = compare([tmp_path / "r.json"], plot=tmp_path / "kld.png")
    assert [r["name"] for r in res["rows"]] == [f.name for f in files]
